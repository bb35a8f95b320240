"""The docs stay true to the code: hook signatures, the loss catalogue, and hook coverage.

Each check reads the live objects (hookspecs, registry), so a new hook or loss fails here
until it is documented and tested.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest

from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import hooks as hookspecs
from skyrl_sdk.plugins import manager
from skyrl_sdk.plugins.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: hook -> the Registry method its ``register`` callback is bound to (see plugins/manager.py)
REGISTER_METHODS = {hook: getattr(Registry, method) for hook, method in manager.REGISTRATION_HOOKS.items()}


def hookspec_functions() -> dict[str, object]:
    marker = f"{manager.ENTRY_POINT_GROUP}_spec"  # the attribute pluggy's HookspecMarker sets
    return {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, marker)}


def bare_signature(fn, drop: tuple[str, ...] = ()) -> str:
    """``(a, b=1, *, c)``: parameters with defaults, without annotations."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values() if p.name not in drop]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_there_are_hookspecs_and_each_has_a_register_method():
    assert set(hookspec_functions()) == set(REGISTER_METHODS)


@pytest.mark.parametrize("name", sorted(REGISTER_METHODS))
def test_hook_documented_with_exact_signature(name):
    text = (DOCS / "hooks.md").read_text()
    fn = hookspec_functions()[name]
    assert f"def {name}{bare_signature(fn)}" in text
    assert fn.__doc__ and fn.__doc__.strip(), f"hookspec {name} needs a docstring saying when it is called"


@pytest.mark.parametrize("name", sorted(REGISTER_METHODS))
def test_register_callback_documented_with_exact_signature(name):
    text = (DOCS / "hooks.md").read_text()
    signature = "register" + bare_signature(REGISTER_METHODS[name], drop=("self", "plugin"))
    assert signature in text, f"docs/hooks.md should show {signature}"


@pytest.mark.parametrize("name", sorted(REGISTER_METHODS))
def test_hookspec_docstring_shows_the_register_signature(name):
    """The ``register(...)`` call in each hookspec's docstring is the real callback's signature."""
    doc = " ".join(hookspec_functions()[name].__doc__.split())
    match = re.search(r"``register(\(.*?\))``", doc)
    assert match, f"hookspec {name}'s docstring should show ``register(...)``"
    expected = bare_signature(REGISTER_METHODS[name], drop=("self", "plugin"))
    assert match.group(1).replace('"', "'") == expected


# ---- the loss catalogue --------------------------------------------------------------------


def builtin_losses() -> dict:
    registry = plugins.get_registry()
    return {
        name: spec for name, spec in sorted(registry.losses.items())
        if registry.owners[("loss", name)] in plugins.builtin_plugin_names()
    }


def loss_section(text: str, name: str) -> str:
    match = re.search(rf"^### `{re.escape(name)}`\s*$(.*?)(?=^#{{1,3}} |\Z)", text, re.M | re.S)
    assert match, f"docs/losses.md has no '### `{name}`' section"
    return match.group(1)


def test_builtin_losses_exist():
    assert "cross_entropy" in builtin_losses()


@pytest.mark.parametrize("name", sorted(builtin_losses()))
def test_builtin_loss_documented_with_config_defaults(name):
    path = DOCS / "losses.md"
    if not path.exists():
        pytest.fail("docs/losses.md is missing")
    section = loss_section(path.read_text(), name)
    spec = builtin_losses()[name]
    defaults = attrs.asdict(spec.config_cls(), recurse=False) if spec.config_cls else {}
    for key, value in defaults.items():
        assert f"`{key}`" in section, f"loss {name}: config key {key!r} not in its docs section"
        assert f"`{value!r}`" in section, f"loss {name}: default {key}={value!r} (in backticks) not in its docs section"


# ---- every hook has a test -----------------------------------------------------------------


def test_every_hook_is_exercised_by_a_test():
    test_files = [p for p in ROOT.glob("tests/**/*.py") if p.name != Path(__file__).name]
    test_files += list(ROOT.glob("plugins/*/tests/**/*.py"))
    sources = "\n".join(p.read_text() for p in test_files)
    missing = [name for name in hookspec_functions() if not re.search(rf"\b{name}\b", sources)]
    assert not missing, f"hooks with no test that implements or calls them: {missing}"


def test_backend_md_gives_each_method_its_real_defaults():
    """Every ``name=default`` in docs/backend.md's table of Backend methods is that parameter's
    real default (the table said ``loss_fn="cross_entropy"`` where the signature has None)."""
    import ast
    import inspect
    import re

    from skyrl_sdk import Backend

    text = (DOCS / "backend.md").read_text()
    checked = 0
    for name, args in re.findall(r"^\| `(\w+)\(([^`]*)\)`", text, re.M):
        method = getattr(Backend, name, None)
        assert method is not None, f"docs/backend.md names Backend.{name}, which does not exist"
        params = inspect.signature(method).parameters
        for key, default in re.findall(r"(\w+)=([^,]+)", args):
            assert key in params, f"Backend.{name} has no parameter {key!r}"
            assert ast.literal_eval(default) == params[key].default, (name, key, default, params[key].default)
            checked += 1
    assert checked >= 10


# ---- docs that stay true: what landed is named where a newcomer looks ---------------------------------------
ROOT = DOCS.parent


def _extras_table(text: str) -> str:
    start = text.index("| install")
    return text[start:text.index("\n\n", start)]


def test_every_plugin_is_in_the_install_tables_the_layout_and_the_changelog():
    readme, install = (ROOT / "README.md").read_text(), (DOCS / "install.md").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    unreleased = changelog[changelog.index("## Unreleased"):changelog.index("\n## ", changelog.index("## Unreleased") + 5)]
    plugins = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())
    assert plugins
    for name in plugins:
        assert f"plugins/{name}" in _extras_table(readme), f"README's extras table lacks {name}"
        assert f"plugins/{name}" in _extras_table(install), f"install.md's extras table lacks {name}"
        assert f"`plugins/{name}/`" in readme.split("## Layout", 1)[1], f"README's Layout lacks {name}"
    assert "plugins/skyrl-sdk-vllm" in unreleased  # the plugins that landed since 0.1.0
    for landed in ("Vision-language models", "`stable_reinforce`", "`skyrl-sdk doctor`"):
        assert landed in unreleased, landed


def test_every_tox_env_is_named_where_the_test_command_is():
    """The README and install.md name each tox environment a contributor runs (tox -e NAME)."""
    import configparser

    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")
    envs = [s.split(":", 1)[1] for s in config.sections() if s.startswith("testenv:")]
    assert envs
    for name in envs:
        for path in (ROOT / "README.md", DOCS / "install.md"):
            assert f"tox -e {name}" in path.read_text(), f"{path.name} does not name tox -e {name}"


def test_the_readme_hard_codes_no_test_counts():
    """Test counts go stale with every test added (the README said 1,562 / 266 for 1,563 / 275):
    each pytest command prints its own."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert not re.findall(r"\d[\d,]* (?:server )?tests\b", readme), re.findall(r"\d[\d,]* (?:server )?tests\b", readme)
