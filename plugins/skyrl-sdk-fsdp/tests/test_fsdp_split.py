"""Pure-Python parts of the fsdp plugin: the token-balanced split, options, registration,
rank errors' types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl_sdk_fsdp")

from skyrl_sdk import errors
from skyrl_sdk.errors import InputError
from skyrl_sdk_fsdp.options import FSDPOptions, launcher_env
from skyrl_sdk_fsdp.split import split_by_tokens
from skyrl_sdk_fsdp.transport import judge_replies


def _check_partition(parts, n):
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))
    assert all(p == sorted(p) for p in parts)


@pytest.mark.parametrize("lengths,world", [
    ([7, 12, 3, 20, 9], 2), ([5], 2), ([5, 5, 5], 2), ([1] * 7, 3), ([100, 1, 1, 1, 1], 2), ([], 2), ([3, 4], 4),
])
def test_split_is_a_balanced_partition(lengths, world):
    parts = split_by_tokens(lengths, world)
    assert len(parts) == world
    _check_partition(parts, len(lengths))
    loads = [sum(lengths[i] for i in p) for p in parts]
    # greedy LPT: no rank exceeds the lightest by more than the longest datum
    if lengths:
        assert max(loads) - min(loads) <= max(lengths)


def test_split_balances_tokens_not_datums():
    parts = split_by_tokens([100, 1, 1, 1, 1], 2)
    assert parts == [[0], [1, 2, 3, 4]]
    assert split_by_tokens([7, 12, 3, 20, 9], 2) == [[0, 3], [1, 2, 4]]
    # equal tokens: the datums spread out instead of piling onto rank 0
    assert split_by_tokens([1] * 4, 2) == [[0, 2], [1, 3]]
    assert split_by_tokens([5], 3) == [[0], [], []]


def test_options():
    assert FSDPOptions.from_extra({}) == FSDPOptions()
    with pytest.raises(InputError, match="state_format"):
        FSDPOptions.from_extra({"state_format": "zip"})
    with pytest.raises(InputError, match="timeout_s"):
        FSDPOptions.from_extra({"timeout_s": 0})
    with pytest.raises(InputError, match="threads_per_rank"):
        FSDPOptions.from_extra({"threads_per_rank": 0})
    assert FSDPOptions(threads_per_rank=3).threads(2) == 3


def test_launcher_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert launcher_env() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = launcher_env()
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)


def test_registered_through_the_entry_point_and_not_imported_by_the_core():
    code = (
        "import sys, skyrl_sdk.backend, skyrl_sdk.engines.local\n"
        "assert 'skyrl_sdk_fsdp' not in sys.modules\n"
        "from skyrl_sdk import get_plugins\n"
        "p = [p for p in get_plugins().plugins if p.name == 'fsdp'][0]\n"
        "assert p.package == 'skyrl-sdk-fsdp' and p.registered == ('engine:fsdp',), p\n"
        "assert 'torch.distributed.fsdp' not in sys.modules  # registering is cheap\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=1800)  # a hang guard
    core = Path(__import__("skyrl_sdk").__file__).parent
    assert not [f for f in core.rglob("*.py") if "skyrl_sdk_fsdp" in f.read_text()]


def _core_imports(file: Path):
    import ast

    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "skyrl_sdk":
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "skyrl_sdk":
                    yield alias.name, []


def test_plugin_uses_only_documented_core_names_and_modules_stay_small():
    """Every name the plugin takes from the core is public and listed, with its module, in the
    engine authors' tables of docs/engines.md (what an engine plugin may use)."""
    import re

    import skyrl_sdk.engines

    docs = (Path(__file__).resolve().parents[3] / "docs" / "engines.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    package = Path(__import__("skyrl_sdk_fsdp").__file__).parent
    files = sorted(package.glob("*.py"))
    assert len(files) >= 9
    for file in files:
        for module, names in _core_imports(file):
            for name in names:
                assert not name.startswith("_"), f"{file.name} takes the private {module}.{name}"
                if module in ("skyrl_sdk", "skyrl_sdk.types", "skyrl_sdk.errors"):
                    continue  # the public face, the types and the errors: everyone's API
                if module == "skyrl_sdk.engines":
                    assert name in skyrl_sdk.engines.__all__, f"{file.name}: {name}"
                    continue
                listed = [r for r in rows if f"`{module}`" in r and re.search(rf"`{re.escape(name)}\b", r)]
                assert listed or f"`{module}.{name}`" in docs, \
                    f"{file.name} imports {module}.{name}, which docs/engines.md does not list for engine authors"
        assert len(file.read_text().splitlines()) <= 450, file.name
    for name in skyrl_sdk.engines.__all__:
        assert getattr(skyrl_sdk.engines, name) is not None


@pytest.mark.parametrize("kind, clean, expected, fatal", [
    ("ModelLoadError", True, errors.ModelLoadError, False),   # every rank, before any collective
    ("PluginError", True, errors.PluginError, False),
    ("PluginError", False, errors.PluginError, True),         # mid-call: the engine is stopped, the cause kept
    ("InputError", False, errors.EngineError, True),
    ("ValueError", True, errors.EngineError, False),
])
def test_rank_errors_keep_a_type_that_says_whose_fault(kind, clean, expected, fatal):
    def failed(rank):
        return "error", {"rank": rank, "type": kind, "message": f"{kind} here", "traceback": "tb", "clean": clean,
                         "comm": False}

    results, error, is_fatal = judge_replies("run", {0: failed(0), 1: failed(1)}, {}, 2)
    assert results == [] and type(error) is expected and is_fatal is fatal
    assert str(error).startswith(f"{kind} here") or isinstance(error, errors.EngineError)
