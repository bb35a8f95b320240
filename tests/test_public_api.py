"""The public API stays what the docs promise: one import for plugin authors, documented
fields on every public type, and modules small enough to read."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import attrs
import pytest
import tomllib

import skyrl_sdk
from skyrl_sdk import types

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_AUTHOR_API = (
    "hookimpl", "Register", "LossInput", "LossOutput", "LossSpec", "Metric", "metric_sum", "metric_mean", "metric_max",
    "metric_min", "segment_sum", "segment_mean", "safe_ratio", "number_validator", "evaluate_loss",
)


@pytest.mark.parametrize("name", PLUGIN_AUTHOR_API)
def test_plugin_authors_need_one_import(name):
    assert name in skyrl_sdk.__all__
    assert getattr(skyrl_sdk, name) is not None


def test_everything_in_all_resolves():
    for name in skyrl_sdk.__all__:
        getattr(skyrl_sdk, name)
    for name in types.__all__:
        getattr(types, name)


def test_a_type_checker_sees_every_lazy_name_as_itself():
    """skyrl_sdk's torch-heavy names are imported on first use (``__getattr__``, typed ``Any``);
    the ``if TYPE_CHECKING`` block imports each from the module ``__getattr__`` uses, so a
    plugin's or a user's mypy checks calls to ``skyrl_sdk.Backend`` against its signature."""
    tree = ast.parse(Path(skyrl_sdk.__file__).read_text())
    guarded = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    assert len(guarded) == 1, "skyrl_sdk/__init__.py has no (or more than one) `if TYPE_CHECKING:` block"
    imported = {alias.asname or alias.name: node.module for node in guarded[0].body
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    lazy = {name for name in skyrl_sdk.__all__ if name not in vars(skyrl_sdk)}
    assert set(imported) == lazy
    for name, module in imported.items():
        assert getattr(importlib.import_module(f"skyrl_sdk.{module}"), name) is getattr(skyrl_sdk, name), name


def test_every_package_is_marked_typed():
    """PEP 561: the core and each plugin ship ``py.typed`` (declared as package data, present in
    the package), or a type checker treats them as untyped and every call into them as ``Any``."""
    projects = [ROOT, *sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())]
    assert len(projects) == 5
    for project in projects:
        config = tomllib.loads((project / "pyproject.toml").read_text())
        data = config["tool"]["setuptools"]["package-data"]
        packages = [p.name for p in (project / "src").iterdir() if (p / "__init__.py").is_file()]
        assert len(packages) == 1, project
        assert "py.typed" in data.get(packages[0], []), f"{project.name}: py.typed not in package-data"
        assert (project / "src" / packages[0] / "py.typed").is_file(), f"{packages[0]}/py.typed is missing"


def _public_attrs_classes():
    return [getattr(types, n) for n in types.__all__ if inspect.isclass(getattr(types, n)) and attrs.has(getattr(types, n))]


@pytest.mark.parametrize("cls", _public_attrs_classes(), ids=lambda c: c.__name__)
def test_every_field_of_a_public_type_is_documented(cls):
    """Each field is preceded by a ``#:`` comment (what Sphinx autodoc reads as its docstring)."""
    source = inspect.getsource(cls)
    for field in attrs.fields(cls):
        pattern = rf"#:[^\n]*\n(?:\s*#:[^\n]*\n)*\s*{re.escape(field.name)}\s*:"
        assert re.search(pattern, source), f"{cls.__name__}.{field.name} has no '#:' doc comment"
    assert cls.__doc__ and cls.__doc__.strip()


def test_no_module_is_over_450_lines():
    files = list((ROOT / "src").rglob("*.py")) + list(ROOT.glob("plugins/*/src/**/*.py"))
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_every_engine_author_name_is_documented():
    """docs/engines.md names everything ``skyrl_sdk.engines`` exports (as code: `name...`)."""
    import skyrl_sdk.engines

    text = (ROOT / "docs" / "engines.md").read_text()
    missing = [n for n in skyrl_sdk.engines.__all__ if not re.search(rf"`{re.escape(n)}\b", text)]
    assert not missing, f"names in skyrl_sdk.engines.__all__ that docs/engines.md does not document: {missing}"
