"""The layers of docs/architecture.md hold in the code.

Every import goes to the same or a lower layer: lazy imports, both branches of
``if TYPE_CHECKING:``, and import strings (``importlib.import_module("skyrl_sdk....")``, and
any other string naming one of our modules: what a loader imports later) included. No modules
import each other in a cycle. No module takes a ``_private`` name of another package:
imported by name, read from a module of another package, or read as an attribute of an
object (``runner._optimizer()``) when the name is one only other packages define; a third
party's private name only from the short list below, each with its reason. Inside the FSDP
plugin imports go one way (controller -> dispatcher -> one rank's engine -> building blocks).
The benchmarks, examples and scripts are held to the same rules, as clients above everything.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {
    "skyrl_sdk": ROOT / "src" / "skyrl_sdk",
    "skyrl_sdk_fsdp": ROOT / "plugins" / "skyrl-sdk-fsdp" / "src" / "skyrl_sdk_fsdp",
    "skyrl_sdk_reinforce": ROOT / "plugins" / "skyrl-sdk-reinforce" / "src" / "skyrl_sdk_reinforce",
    "skyrl_sdk_vllm": ROOT / "plugins" / "skyrl-sdk-vllm" / "src" / "skyrl_sdk_vllm",
    "skyrl_sdk_ray": ROOT / "plugins" / "skyrl-sdk-ray" / "src" / "skyrl_sdk_ray",
}
#: What uses the SDK from outside: modules named by their path from the repository root.
CLIENT_DIRS = ("benchmarks", "examples", "scripts", "plugins/skyrl-sdk-fsdp/scripts", "plugins/skyrl-sdk-vllm/scripts")
#: Bottom to top; a module may import its own layer and the layers below. The plugin
#: packages sit above all of them (they may use any public name of the core), the clients on top.
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
                "skyrl_sdk.testing", "skyrl_sdk.builtin_plugins")),
    ("server", ("skyrl_sdk.server",)),
    ("cli", ("skyrl_sdk.cli",)),
    ("plugin packages", ("skyrl_sdk_fsdp", "skyrl_sdk_reinforce", "skyrl_sdk_vllm", "skyrl_sdk_ray")),
    ("clients", ("benchmarks", "examples", "scripts", "plugins")),
)
#: Inside the FSDP plugin, bottom to top (docs/architecture.md).
FSDP_LAYERS = (
    ("building blocks", ("session", "control", "options", "loading", "parallelize", "gather", "sharded_state",
                         "sharded_runner", "push")),
    ("one rank's engine", ("rank_engine",)),
    ("the request dispatcher", ("dispatch",)),
    ("controller and entry points", ("engine", "entrypoint", "transport", "split", "sampling", "ray_rank",
                                     "ray_transport", "")),
)
#: Inside the server, bottom to top: its folders are its layers (docs/architecture.md); the
#: settings (``config``) below them all, the package's face (``create_app``, ``ServerConfig``) on top.
SERVER_LAYERS = (
    ("settings", ("skyrl_sdk.server.config", "skyrl_sdk.server.settings")),
    ("wire", ("skyrl_sdk.server.wire",)),
    ("state", ("skyrl_sdk.server.state",)),
    ("compute", ("skyrl_sdk.server.compute",)),
    ("http", ("skyrl_sdk.server.http",)),
    ("the package's face", ("skyrl_sdk.server",)),
)
#: A third party's private names we read or write, and why there is no public way. Our own
#: packages may not define these names (the list cannot hide a private of ours).
THIRD_PARTY_PRIVATE = {
    "_exit": "os._exit: the documented way to end a process without running exit handlers",
    "_foreach_add_": "torch's foreach kernels (what torch.optim and clip_grad_norm_ run); no public alias",
    "_foreach_mul_": "torch's foreach kernels (what torch.optim and clip_grad_norm_ run); no public alias",
    "_parameters": "torch.nn.Module: replacing a parameter in place while a constructor registers it",
    "_forward_hooks": "torch.nn.Module: no public way to ask whether a module has hooks",
    "_forward_pre_hooks": "torch.nn.Module: no public way to ask whether a module has hooks",
    "_global_forward_hooks": "torch.nn.modules.module: no public way to ask for global hooks",
    "_base": "torch.Tensor: whether a tensor is a view (no public predicate)",
    "_actions": "argparse: a parser's options are listed nowhere else",
    "_attn_implementation": "transformers' config attribute that selects each layer's attention function",
    "_adapter_manager": "vLLM's WorkerLoRAManager: its add_adapter reads a directory; registering an adapter "
                        "built from tensors (skyrl_sdk_vllm.worker) goes to the model manager it wraps",
    "_private": "ray._private.services.resolve_ip_for_localhost: Ray turns 127.0.0.1 into the interface address "
                "in ray start and ray.init (ray-project/ray#59110); a loopback cluster (skyrl_sdk_ray.loopback, "
                "cluster.keep_loopback) has no other way to keep it",
    "_node_ip_address": "ray.init's keyword for the driver's node address: a loopback cluster's driver must say "
                        "127.0.0.1 (skyrl_sdk_ray.cluster.connect)",
}
_IMPORTERS = ("import_module", "__import__", "find_spec", "resolve_name")


def _module_files() -> dict[str, Path]:
    found = {}
    for root in SOURCES.values():
        for file in root.rglob("*.py"):
            parts = list(file.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    for client in CLIENT_DIRS:
        for file in (ROOT / client).rglob("*.py"):
            parts = [p.replace("-", "_") for p in file.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    return found


MODULES = _module_files()


def layer_of(module: str, layers=LAYERS) -> int:
    """The index in ``layers`` of the longest prefix that names ``module`` or a package above it."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it (and to docs/architecture.md)"
    return best


def _package_of(module: str) -> str:
    """The package a module belongs to (a package ``__init__`` belongs to itself)."""
    return module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]


def _ours(name: str) -> bool:
    return name.split(".")[0] in SOURCES or name in MODULES


@cache
def _tree(file: Path) -> ast.Module:
    return ast.parse(file.read_text())


def _resolve(module: str, file: Path, level: int, name: str | None) -> str:
    base = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - level + 1]
    return ".".join(base + ([name] if name else []))


def _imports_of(module: str, file: Path, node: ast.AST):
    """``(line, target module, imported names)`` of one import statement, for our packages only.
    ``from pkg import submodule`` counts as an import of the submodule, not of the package."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                yield node.lineno, alias.name, ()
        return
    source = _resolve(module, file, node.level, node.module) if node.level else node.module or ""
    if not _ours(source):
        return
    names = tuple(a.name for a in node.names)
    submodules = [f"{source}.{n}" for n in names if f"{source}.{n}" in MODULES]
    if submodules and len(submodules) == len(names):
        for sub in submodules:
            yield node.lineno, sub, ()
    else:
        yield node.lineno, source, names


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _string_imports(module: str, file: Path, tree: ast.AST):
    """``(line, module)`` for import strings: the first argument of ``import_module`` (and its
    kin), resolved when relative, and any other string that names one of our modules (alone or
    as ``module:object``), docstrings aside: a loader's list imports what it names."""
    docstrings = _docstrings(tree)
    seen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and ast.unparse(node.func).endswith(_IMPORTERS):
            name = node.args[0].value.split(":")[0]
            if name.startswith("."):
                name = _resolve(module, file, len(name) - len(name.lstrip(".")), name.lstrip(".") or None)
            seen.add(id(node.args[0]))
            if _ours(name):
                yield node.lineno, name
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in seen | docstrings:
            name = node.value.split(":")[0]
            if name in MODULES and "." in name:
                yield node.lineno, name


def _imports(module: str, file: Path):
    """Every import of our packages in ``file``: statements anywhere (both branches of
    ``if TYPE_CHECKING:`` included) and import strings (``(line, target, names)``)."""
    tree = _tree(file)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _imports_of(module, file, node)
    for line, target in _string_imports(module, file, tree):
        yield line, target, ()


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


# ---- private names ---------------------------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_base(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: an object's own attributes."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assignments, arguments, and
    attributes of its own objects (``self._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own_base(node.value):
            names.add(node.attr)
    return {n for n in names if _private(n)}


@cache
def _defined_by_package() -> dict[str, frozenset[str]]:
    """Private name -> the packages that define it."""
    owners: dict[str, set[str]] = {}
    for module, file in MODULES.items():
        for name in _definitions(_tree(file)):
            owners.setdefault(name, set()).add(_package_of(module))
    return {name: frozenset(packages) for name, packages in owners.items()}


def _attribute_uses(tree: ast.AST):
    """``(line, base expression, name, own?)`` of every ``x._name`` and ``getattr(x, "_name")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.value, node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            yield node.lineno, node.args[0], node.args[1].value


def private_uses(module: str, file: Path, defined: dict[str, frozenset[str]] | None = None) -> list[str]:
    """``_private`` names ``module`` takes from other packages: imported by name, read from a
    module of another package it imported, or used on an object when only other packages
    define the name (a third party's: unless :data:`THIRD_PARTY_PRIVATE` lists it)."""
    defined = _defined_by_package() if defined is None else defined
    package = _package_of(module)
    tree = _tree(file)
    bad, bound = [], set()
    for line, source, names in _imports(module, file):
        bad += [f"line {line}: {source}.{name}" for name in names
                if _private(name) and _package_of(source) != package]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for _, target, names in _imports_of(module, file, node):
                if not names and _package_of(target) != package:
                    bound.add(next(a.asname or a.name for a in node.names if target.endswith("." + a.name)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES and _package_of(alias.name) != package:
                    bound.add(alias.asname)
    for line, base, name in _attribute_uses(tree):
        where = f"line {line}: {ast.unparse(base)}.{name}"
        owners = defined.get(name, frozenset())
        if isinstance(base, ast.Name) and base.id in bound:
            bad.append(where)  # a module of another package
        elif package in owners:
            continue  # a name of its own package (``self._x``, or an object of its own)
        elif owners:
            bad.append(f"{where} (a private name of {', '.join(sorted(owners))})")
        elif not _own_base(base) and name not in THIRD_PARTY_PRIVATE:
            bad.append(f"{where} (a third party's private name)")
    return sorted(bad, key=lambda where: int(where.split(":")[0].removeprefix("line ")))


# ---- the tests ---------------------------------------------------------------------------------
def test_the_scanner_sees_our_packages_and_the_clients():
    assert len(MODULES) > 110
    assert {"skyrl_sdk.backend", "skyrl_sdk.engines.runner", "skyrl_sdk_fsdp.rank_engine", "benchmarks.run",
            "examples.grpo", "scripts.make_tiny_assets", "plugins.skyrl_sdk_fsdp.scripts.fsdp_memory"} <= set(MODULES)
    edges = _graph()
    assert "skyrl_sdk.losses.run" in edges["skyrl_sdk.engines.runner"]
    assert "skyrl_sdk.sampling.decode" in edges["skyrl_sdk.sampling.decoder"]  # a lazy import counts
    assert "skyrl_sdk.cli.demo" in edges["skyrl_sdk.cli.commands"]  # an import string counts


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


def test_the_import_scan_sees_strings_and_both_type_checking_branches(tmp_path):
    file = tmp_path / "manager.py"
    file.write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..engines import local\nelse:\n    from ..sampling import decode\n"
        "BUILTINS = ('skyrl_sdk.engines.runner', 'skyrl_sdk.models.loading:load_model')\n"
        "importlib.import_module('skyrl_sdk.server.http.app')\nimportlib.import_module('..cli.demo', __package__)\n"
        "NOT_A_MODULE = 'skyrl_sdk.owner'\n")
    found = sorted((line, target) for line, target, _ in _imports("skyrl_sdk.plugins.manager", file))
    assert found == [(4, "skyrl_sdk.engines.local"), (6, "skyrl_sdk.sampling.decode"),
                     (7, "skyrl_sdk.engines.runner"), (7, "skyrl_sdk.models.loading"),
                     (8, "skyrl_sdk.server.http.app"), (9, "skyrl_sdk.cli.demo")], found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "skyrl_sdk_fsdp"))
def test_the_fsdp_plugin_goes_one_way(module):
    """controller and entry points -> dispatcher -> one rank's engine -> building blocks."""
    def inner(name: str) -> str:
        return name.removeprefix("skyrl_sdk_fsdp").lstrip(".")

    mine = layer_of(inner(module), FSDP_LAYERS)
    upward = [f"line {line}: {target} ({FSDP_LAYERS[layer_of(inner(target), FSDP_LAYERS)][0]})"
              for line, target, _ in _imports(module, MODULES[module])
              if target.split(".")[0] == "skyrl_sdk_fsdp" and layer_of(inner(target), FSDP_LAYERS) > mine]
    assert not upward, f"{module} ({FSDP_LAYERS[mine][0]}) imports from above it: {upward}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("skyrl_sdk.server")))
def test_the_server_folders_are_layers(module):
    """wire -> state -> compute -> http, each importing only its own folder and those below."""
    mine = layer_of(module, SERVER_LAYERS)
    upward = [f"line {line}: {target} ({SERVER_LAYERS[layer_of(target, SERVER_LAYERS)][0]})"
              for line, target, _ in _imports(module, MODULES[module])
              if target.startswith("skyrl_sdk.server.") and layer_of(target, SERVER_LAYERS) > mine]
    assert not upward, f"{module} ({SERVER_LAYERS[mine][0]}) imports from a server layer above it: {upward}"


def test_every_server_module_is_in_a_layer_folder():
    loose = [m for m in MODULES if m.startswith("skyrl_sdk.server.") and m.count(".") == 2
             and m not in ("skyrl_sdk.server.config", "skyrl_sdk.server.settings") and MODULES[m].name != "__init__.py"]
    assert not loose, f"server modules outside the layer folders (wire/ state/ compute/ http/): {loose}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_packages(module):
    bad = private_uses(module, MODULES[module])
    assert not bad, f"{module} uses private names of other packages: {bad}"


def test_the_private_name_check_sees_every_form(tmp_path):
    file = tmp_path / "engine.py"
    file.write_text(
        "from ..models.loading import _secret, load_model\nfrom .. import models\n"
        "from ..models import scoring\nfrom . import runner\n"
        "scoring._hidden(runner._own)\n"
        "class Engine:\n    def __init__(self):\n        self._mine = 1\n"
        "    def step(self, other):\n        self.runner._ensure(other._mine, self._inherited)\n"
        "        getattr(other, '_numpy')\n        return models.x, torch._foreach_mul_\n")
    defined = {"_ensure": frozenset({"skyrl_sdk.engines2"}), "_inherited": frozenset({"skyrl_sdk.models"}),
               "_mine": frozenset({"skyrl_sdk.engines"}), "_own": frozenset({"skyrl_sdk.engines"})}
    found = private_uses("skyrl_sdk.engines.engine", file, defined)
    assert found == ["line 1: skyrl_sdk.models.loading._secret", "line 5: scoring._hidden",
                     "line 10: self.runner._ensure (a private name of skyrl_sdk.engines2)",
                     "line 10: self._inherited (a private name of skyrl_sdk.models)",
                     "line 11: other._numpy (a third party's private name)"], found


def test_the_third_party_list_names_no_private_of_ours():
    ours = sorted(set(THIRD_PARTY_PRIVATE) & set(_defined_by_package()))
    assert not ours, f"defined by our packages, so not a third party's: {ours}"


def test_every_layer_is_documented():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for name, prefixes in LAYERS[:-1]:
        for prefix in prefixes:
            shown = prefix.replace(".", "/") if prefix != "skyrl_sdk" else "skyrl_sdk/__init__"
            assert f"`{prefix}`" in text or shown in text, f"docs/architecture.md does not name {prefix} ({name})"
    for _, modules in FSDP_LAYERS:
        for module in filter(None, modules):
            assert f"`{module}.py`" in text, f"docs/architecture.md does not place the FSDP plugin's {module}.py"


def test_the_module_map_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1]
    missing = [m for m in MODULES if m.startswith("skyrl_sdk.") and m.count(".") >= 2
               and f" {m.rsplit('.', 1)[1]} " not in f" {' '.join(block.replace('(', ' ').split())} "]
    assert not missing, f"docs/architecture.md's module map misses {missing}"


# ---- no mixins -----------------------------------------------------------------------------------
#: bases that bring no attributes a subclass reads (the check follows every other base of ours)
NEUTRAL_BASES = {"object", "abc.ABC", "ABC", "Generic", "Protocol", "Exception"}


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines for its instances: methods, class attributes, annotated fields
    (attrs), and every ``self.x = ...`` / ``cls.x = ...`` in its methods."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own_base(node.value):
            names.add(node.attr)
    return names


@cache
def _classes() -> dict[tuple[str, str], tuple[str, ast.ClassDef]]:
    """(module, class name) -> (module, class) of every class of our packages and the names
    modules import them by."""
    found: dict[tuple[str, str], tuple[str, ast.ClassDef]] = {}
    for module, file in MODULES.items():
        for node in _tree(file).body:
            if isinstance(node, ast.ClassDef):
                found[(module, node.name)] = (module, node)
    for module, file in MODULES.items():
        for node in ast.walk(_tree(file)):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, file, node.level, node.module) if node.level else node.module or ""
                for alias in node.names:
                    if (source, alias.name) in found:
                        found.setdefault((module, alias.asname or alias.name), found[(source, alias.name)])
    return found


def undefined_attributes(module: str, cls: ast.ClassDef, classes: dict | None = None) -> set[str] | None:
    """The ``self.x`` a class reads that neither it nor its bases define (a mixin reading its
    host's names); None when a base is not ours (a third party's may define anything)."""
    classes = _classes() if classes is None else classes
    known, todo, seen = set(), [(module, cls)], set()
    while todo:
        mod, node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        known |= _own_names(node)
        for base in node.bases:
            name = ast.unparse(base.value if isinstance(base, ast.Subscript) else base)
            if name in NEUTRAL_BASES:
                continue
            if (mod, name) not in classes:
                return None
            todo.append(classes[(mod, name)])
    reads = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return reads - known - {"__class__", "__dict__"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _ours(m) and m.split(".")[0] in SOURCES))
def test_no_class_reads_attributes_only_its_host_defines(module):
    """A class is one job with its own state: a mixin that reads its host's ``self.store`` or
    ``self._sequenced`` splits one class over two modules and hides what it depends on (make it
    a service object handed what it uses, as ``server.compute.weights.WeightRequests``)."""
    bad = {}
    for node in _tree(MODULES[module]).body:
        if isinstance(node, ast.ClassDef) and (missing := undefined_attributes(module, node)):
            bad[node.name] = sorted(missing)
    assert not bad, f"{module}: classes read attributes they do not define (a mixin?): {bad}"


def test_the_mixin_check_sees_a_mixin():
    tree = ast.parse("class Mixin:\n    def save(self):\n        return self.store.save(self._sequenced)\n\n"
                     "class Host(Mixin):\n    def __init__(self):\n        self.store = self._sequenced = None\n\n"
                     "class Foreign(dict):\n    def get_it(self):\n        return self.anything\n")
    mixin, host, foreign = tree.body
    classes = {("m", "Mixin"): ("m", mixin), ("m", "Host"): ("m", host)}
    assert undefined_attributes("m", mixin, classes) == {"store", "_sequenced"}
    assert undefined_attributes("m", host, classes) == set()  # the host defines them: the mixin is the one
    assert undefined_attributes("m", foreign, classes) is None  # a third party's base may define anything


# ---- tests use public names and skyrl_sdk.testing -----------------------------------------------
def _test_modules() -> dict[str, Path]:
    """Every module of the test suites (test files and their helpers), by its path from the root."""
    files = [*(ROOT / "tests").glob("*.py"), *ROOT.glob("plugins/*/tests/*.py")]
    return {".".join(p.replace("-", "_") for p in f.relative_to(ROOT).with_suffix("").parts): f for f in files}


TEST_MODULES = _test_modules()


def private_uses_in_tests(module: str, file: Path) -> list[str]:
    """:func:`private_uses` for a test module: the private names its own folder of tests
    defines are its own; every other package's are not (a test reads what users can read, or a
    ``skyrl_sdk.testing`` hook that keeps the knowledge of internals in the package)."""
    folder = file.parent
    own = set().union(*(_definitions(_tree(f)) for f in folder.glob("*.py")))
    defined = dict(_defined_by_package())
    for name in own:
        defined[name] = defined.get(name, frozenset()) | {_package_of(module)}
    return private_uses(module, file, defined)


@pytest.mark.parametrize("module", sorted(TEST_MODULES))
def test_tests_use_no_private_names_of_ours(module):
    bad = private_uses_in_tests(module, TEST_MODULES[module])
    assert not bad, f"{module} reads private names (use a public name or a skyrl_sdk.testing hook): {bad}"


def test_the_test_scan_sees_a_private_read(tmp_path):
    folder = tmp_path / "tests"
    folder.mkdir()
    (folder / "_helper.py").write_text("def _shared():\n    pass\n")
    file = folder / "test_x.py"
    file.write_text("from skyrl_sdk.engines.runner import ModelRunner\nfrom _helper import _shared\n"
                    "def test(b):\n    _shared()\n    b._lock\n    ModelRunner._run_micro_batch\n")
    found = private_uses_in_tests("tests.test_x", file)
    assert [f.split(" (")[0] for f in found] == ["line 5: b._lock", "line 6: ModelRunner._run_micro_batch"], found
