"""``skyrl-sdk losses``: every registered loss as a caller sees it, per dialect, generated from
each loss's declared contract (:mod:`skyrl_sdk.losses.contract`): the names a dialect calls it
by, the inputs a datum must carry, may carry and must never carry, and the ``loss_fn_config``
keys (with defaults) each of those names takes. ``tests/test_loss_contract.py`` checks the
listing against what each loss really accepts."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import attrs

from ..losses.contract import caller_inputs, dialect_config_keys, shared_config_keys
from .output import print_json, print_table


def dialect_names(dialect: Any, spec: Any) -> list[str]:
    """The names a client of ``dialect`` calls ``spec`` by.

    Asks the dialect's own converter (its ``convert.names`` lists the names it maps), so the
    tables stay in the dialect; a native name the dialect does not claim falls through
    to the registry and is callable as it is.
    """
    names = []
    for name in getattr(dialect.convert, "names", ()):
        try:
            converted = dialect.convert(name, None, spec.role)
        except Exception:  # a name that needs a config is still listed by its owner's docs
            continue
        if converted is not None and converted[0] == spec.name:
            names.append(name)
    try:
        shadowed = dialect.convert(spec.name, None, spec.role) is not None
    except Exception:
        shadowed = True
    if not shadowed and spec.name not in names:
        names.append(spec.name)
    return names


def config_defaults(spec: Any) -> dict[str, Any]:
    """Default config values, as an instance built with no arguments holds them (factories run)."""
    if spec.config_cls is None:
        return {}
    return attrs.asdict(spec.config_cls(), recurse=False)


def _tidy(value: Any) -> Any:
    """A derived default as a person writes it (``0.8``, not ``0.7999999999999999``)."""
    return float(f"{value:.12g}") if isinstance(value, float) else value


def loss_rows(dialect: str | None = None) -> list[dict[str, Any]]:
    """One dict per registered loss, sorted by name (``dialect``: that dialect only)."""
    from ..builtin_plugins import get_registry

    registry = get_registry()
    dialects = registry.dialects if dialect is None else {dialect: registry.dialect_spec(dialect)}
    rows = []
    for name in sorted(registry.losses):
        spec = registry.losses[name]
        inputs = caller_inputs(spec)
        names = {d: dialect_names(ds, spec) for d, ds in dialects.items()}
        own = config_defaults(spec)
        by_name = {d: {n: {k: _tidy(own[k] if k in own else v)
                           for k, v in dialect_config_keys(dialects[d], n, spec).items()} for n in ns}
                   for d, ns in names.items()}
        rows.append({
            "name": spec.name,
            "plugin": registry.owners.get(("loss", name)),
            "role": spec.role,
            "dialect_names": names,
            "required_inputs": list(inputs.required),
            "optional_inputs": list(inputs.optional),
            "never_send_inputs": list(inputs.never_send),
            "input_notes": dict(inputs.notes),
            "outputs": list(spec.outputs),
            "config": own,
            "config_by_name": by_name,
            "shared_config_keys": list(shared_config_keys(spec)),
            "accepts_topk_targets": spec.accepts_topk_targets,
            "needs_provenance": spec.needs_provenance,
            "description": spec.description,
        })
    return rows


def _keys_text(keys: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in keys.items()) or "no keys of its own"


def config_lines(row: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, keys)``: one line when every name in every dialect takes the same keys, else
    one per distinct set, labelled by the names (and dialects) that take it."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for d, by_name in row["config_by_name"].items():
        for n, keys in by_name.items():
            groups.setdefault(_keys_text(keys), []).append((n, d))
    if len(groups) <= 1:
        return [("config", next(iter(groups), _keys_text(row["config"])))]
    every = list(row["config_by_name"])
    lines = []
    for text, users in groups.items():
        labels = []
        for n in dict.fromkeys(u[0] for u in users):
            ds = [d for u, d in users if u == n]
            labels.append(n if len(every) == 1 or ds == every else f"{n} ({', '.join(ds)})")
        lines.append((f"config as {', '.join(labels)}", text))
    return lines


def _called_as(row: dict[str, Any]) -> str:
    return "; ".join(f"{d}: {', '.join(n) or '-'}" for d, n in row["dialect_names"].items())


def _inputs_text(row: dict[str, Any]) -> str:
    text = ", ".join(row["required_inputs"]) or "-"
    if row["optional_inputs"]:
        text += " [" + ", ".join(row["optional_inputs"]) + "]"
    if row["never_send_inputs"]:
        text += " {never: " + ", ".join(row["never_send_inputs"]) + "}"
    return text


def _config_text(row: dict[str, Any]) -> str:
    """:func:`config_lines` on one line (the wide table)."""
    return "; ".join(text if label == "config" else f"{label.removeprefix('config as ')}: {text}"
                     for label, text in config_lines(row))


def _print_records(rows: Sequence[dict[str, Any]], width: int) -> None:
    """One block per loss, every line wrapped to ``width`` columns."""
    for i, row in enumerate(rows):
        if i:
            print()
        print(f"{row['name']} ({row['role']})")
        notes = row["input_notes"]
        optional = [f"{k} ({notes[k]})" if k in notes else k for k in row["optional_inputs"]]
        never = [f"{k} ({notes[k]})" if k in notes else k for k in row["never_send_inputs"]]
        lines = [("called as", _called_as(row)),
                 ("inputs", ", ".join(row["required_inputs"]) or "-"), ("optional", ", ".join(optional)),
                 ("never send", ", ".join(never)), *config_lines(row), ("", row["description"])]
        for label, text in lines:
            if not text:
                continue
            lead = f"  {label}: " if label else "  "
            print(textwrap.fill(text, width=width, initial_indent=lead, subsequent_indent=" " * len(lead),
                                break_on_hyphens=False))


def _shared_note(rows: Sequence[dict[str, Any]]) -> str:
    roles = {r["role"]: r["shared_config_keys"] for r in rows}
    return "Every loss also takes, in every dialect: " + "; ".join(
        f"{role}: {', '.join(keys)}" for role, keys in sorted(roles.items())) + " (docs/losses.md, Loss terms)."


def cmd_losses(args: argparse.Namespace) -> int:
    from ..builtin_plugins import get_registry
    from ..errors import UnknownNameError

    if args.dialect is not None:
        try:
            get_registry().dialect_spec(args.dialect)
        except UnknownNameError as exc:
            print(f"skyrl-sdk: {exc}", file=sys.stderr)
            return 2
    rows = loss_rows(args.dialect)
    if args.json:
        print_json(rows)
        return 0
    width = min(100, shutil.get_terminal_size((100, 24)).columns)
    if args.wide:
        print_table(("NAME", "ROLE", "CALLED AS", "INPUTS [optional] {never}", "CONFIG", "DESCRIPTION"),
                    [(r["name"], r["role"], _called_as(r), _inputs_text(r), _config_text(r), r["description"])
                     for r in rows])
    else:
        _print_records(rows, width)
        print()
    print(textwrap.fill(_shared_note(rows), width=width if not args.wide else 10**6, break_on_hyphens=False))
    return 0
