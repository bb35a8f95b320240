"""The layers of docs/architecture.md hold in the code: every import (lazy ones included,
``if TYPE_CHECKING:`` blocks excluded) goes to the same or a lower layer, no modules import
each other in a cycle, and no module takes a ``_private`` name from another package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "skyrl_sdk": ROOT / "src" / "skyrl_sdk",
    "skyrl_sdk_fsdp": ROOT / "plugins" / "skyrl-sdk-fsdp" / "src" / "skyrl_sdk_fsdp",
    "skyrl_sdk_reinforce": ROOT / "plugins" / "skyrl-sdk-reinforce" / "src" / "skyrl_sdk_reinforce",
}
#: Bottom to top; a module may import its own layer and the layers below. The plugin
#: packages sit above all of them (they may use any public name of the core).
LAYERS = (
    ("contract", ("skyrl_sdk.errors", "skyrl_sdk.hooks", "skyrl_sdk.version")),
    ("types", ("skyrl_sdk.types",)),
    ("inputs", ("skyrl_sdk.inputs",)),
    ("losses", ("skyrl_sdk.losses",)),
    ("plugins", ("skyrl_sdk.plugins",)),
    ("models", ("skyrl_sdk.models",)),
    ("sampling", ("skyrl_sdk.sampling",)),
    ("engines", ("skyrl_sdk.engines",)),
    ("facade", ("skyrl_sdk", "skyrl_sdk.backend", "skyrl_sdk.shared_base", "skyrl_sdk.evaluate", "skyrl_sdk.rl",
                "skyrl_sdk.testing")),
    ("server", ("skyrl_sdk.server",)),
    ("cli", ("skyrl_sdk.cli",)),
    ("plugin packages", ("skyrl_sdk_fsdp", "skyrl_sdk_reinforce")),
)


def _modules() -> dict[str, Path]:
    found = {}
    for root in SOURCES.values():
        for file in root.rglob("*.py"):
            parts = list(file.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names ``module`` or a package above it."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of LAYERS: add it (and to docs/architecture.md)"
    return best


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for child in ast.walk(node))
    return skip


def _package_of(module: str) -> str:
    """The package a module belongs to (a package ``__init__`` belongs to itself)."""
    return module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]


def _imports_of(module: str, file: Path, node: ast.AST):
    """``(line, target module, imported names)`` of one import statement, for our packages only.
    ``from pkg import submodule`` counts as an import of the submodule, not of the package."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                yield node.lineno, alias.name, ()
        return
    if node.level:
        base = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] not in SOURCES:
        return
    names = tuple(a.name for a in node.names)
    submodules = [f"{source}.{n}" for n in names if f"{source}.{n}" in MODULES]
    if submodules and len(submodules) == len(names):
        for sub in submodules:
            yield node.lineno, sub, ()
    else:
        yield node.lineno, source, names


def _imports(module: str, file: Path):
    """Every import of our packages in ``file`` (see :func:`_imports_of`), outside TYPE_CHECKING."""
    tree = ast.parse(file.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) not in skip and isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _imports_of(module, file, node)


def _private_attribute_uses(file: Path, bound_modules: set[str]):
    tree = ast.parse(file.read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound_modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, file in MODULES.items():
        for _, target, _ in _imports(module, file):
            if target in MODULES and target != module:
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_scanner_sees_our_packages():
    assert len(MODULES) > 80
    assert {"skyrl_sdk.backend", "skyrl_sdk.engines.runner", "skyrl_sdk_fsdp.rank_engine"} <= set(MODULES)
    edges = _graph()
    assert "skyrl_sdk.losses.run" in edges["skyrl_sdk.engines.runner"]
    assert "skyrl_sdk.sampling.decode" in edges["skyrl_sdk.sampling.decoder"]  # a lazy import counts


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    mine = layer_of(module)
    upward = [f"line {line}: {target} ({LAYERS[layer_of(target)][0]})"
              for line, target, _ in _imports(module, MODULES[module]) if layer_of(target) > mine]
    assert not upward, f"{module} ({LAYERS[mine][0]}) imports from higher layers: {upward}"


def private_uses(module: str, file: Path) -> list[str]:
    """``_private`` names ``module`` takes from modules of other packages: imported by name, or
    read as an attribute of a module of another package it imported (``from .. import x; x._y``)."""
    package = _package_of(module)
    bad, bound = [], set()
    for line, source, names in _imports(module, file):
        bad += [f"line {line}: {source}.{name}" for name in names
                if name.startswith("_") and not name.startswith("__") and _package_of(source) != package]
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom):
            for _, target, names in _imports_of(module, file, node):
                if not names and _package_of(target) != package:
                    bound.add(next(a.asname or a.name for a in node.names if target.endswith("." + a.name)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES and _package_of(alias.name) != package:
                    bound.add(alias.asname)
    return bad + [f"line {line}: {use}" for line, use in _private_attribute_uses(file, bound)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_packages(module):
    bad = private_uses(module, MODULES[module])
    assert not bad, f"{module} uses private names of other packages: {bad}"


def test_the_private_name_check_sees_both_forms(tmp_path):
    file = tmp_path / "local.py"
    file.write_text("from ..models.loading import _secret, load_model\nfrom .. import models\n"
                    "from ..models import scoring\nfrom . import runner\n"
                    "scoring._hidden(runner._own)\n")
    found = private_uses("skyrl_sdk.engines.local", file)
    assert found == ["line 1: skyrl_sdk.models.loading._secret", "line 5: scoring._hidden"], found


def test_every_layer_is_documented():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            shown = prefix.replace(".", "/") if prefix != "skyrl_sdk" else "skyrl_sdk/__init__"
            assert f"`{prefix}`" in text or shown in text, f"docs/architecture.md does not name {prefix} ({name})"
