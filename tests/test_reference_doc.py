"""docs/reference.md against the real types: every field of every request and result type,
its default (``repr`` in backticks, "required" when there is none), the Backend's arguments
and the calls' signatures. A new field, a changed default or a new type fails here until the
page says so."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest

from skyrl_sdk import Backend, types

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
CALLS = ("forward_backward", "forward", "forward_backward_steps", "forward_steps", "optim_step", "zero_grad", "sample",
         "save_weights_for_sampler", "save_state", "load_state", "get_info")


def documented_types() -> dict[str, type]:
    """The attrs classes ``skyrl_sdk.types`` exports: the types a call takes or returns."""
    return {name: obj for name in types.__all__ if attrs.has(obj := getattr(types, name))}


def section(heading: str) -> str:
    """The text under ``### heading`` up to the next heading."""
    match = re.search(rf"^### {re.escape(heading)}\s*$(.*?)(?=^#{{1,3}} |\Z)", PAGE, re.M | re.S)
    assert match, f"docs/reference.md has no '### {heading}' section"
    return match.group(1)


def table(text: str) -> dict[str, str]:
    """``{name: default cell}`` of a section's table (first column a name in backticks)."""
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M)}


def expected_default(default) -> str:
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):
        return f"`{default.factory()!r}`"
    return f"`{default!r}`"


def type_sections() -> dict[str, str]:
    """type name -> its section; one heading may name several types (`A`, `B`)."""
    out = {}
    for heading in re.findall(r"^### (`\w+`(?:, `\w+`)*)\s*$", PAGE, re.M):
        for name in re.findall(r"`(\w+)`", heading):
            out[name] = section(heading)
    return out


def test_every_type_has_a_section():
    assert set(documented_types()) <= set(type_sections()), set(documented_types()) - set(type_sections())


@pytest.mark.parametrize("name", sorted(documented_types()))
def test_each_field_and_default_is_documented(name):
    rows = table(type_sections()[name])
    for field in attrs.fields(documented_types()[name]):
        assert field.name in rows, f"{name}.{field.name} is not in its docs/reference.md table"
        assert rows[field.name] == expected_default(field.default), (
            f"{name}.{field.name}: the page says {rows[field.name]}, the type's default is "
            f"{expected_default(field.default)}")


def test_no_documented_field_is_made_up():
    sections = {}
    for name, text in type_sections().items():
        sections.setdefault(text, set()).add(name)
    for text, names in sections.items():
        real = {f.name for n in names for f in attrs.fields(documented_types()[n])}
        assert set(table(text)) == real, (names, set(table(text)) ^ real)


def test_the_backend_arguments_and_defaults():
    params = list(inspect.signature(Backend.__init__).parameters.values())[1:]
    assert table(section("`Backend(...)`")) == {p.name: f"`{p.default!r}`" for p in params}


def test_the_calls_signatures():
    block = re.search(r"^### Methods\s*```python\n(.*?)```", PAGE, re.M | re.S).group(1)
    shown = [line for line in block.splitlines() if line.strip()]
    expected = []
    for name in CALLS:
        sig = inspect.signature(getattr(Backend, name))
        params = [p.replace(annotation=inspect.Parameter.empty) for n, p in sig.parameters.items() if n != "self"]
        expected.append(name + str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty)))
    assert shown == expected


def test_the_defaults_are_tinkers_where_tinker_has_one():
    """The page says the defaults are the tinker client's; only SamplingParams.max_tokens, which
    tinker leaves unset, and LoraConfig's rank (required there) and alpha (not a tinker field) differ."""
    tinker = pytest.importorskip("tinker")

    for ours, theirs, differ in ((types.AdamParams, tinker.types.AdamParams, set()),
                                 (types.SamplingParams, tinker.types.SamplingParams, {"max_tokens"}),
                                 (types.LoraConfig, tinker.types.LoraConfig, {"rank"})):
        fields = {f.name: f.default for f in attrs.fields(ours)}
        assert set(theirs.model_fields) <= set(fields), ours.__name__  # every tinker field is ours too
        for key in set(theirs.model_fields) - differ:
            assert fields[key] == theirs.model_fields[key].default, (ours.__name__, key)
    assert tinker.types.SamplingParams().max_tokens is None and "gets these 16 tokens" in PAGE
