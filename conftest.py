"""Repository-wide pytest option ``--suite``: the two processes ``tox`` runs the tests in.

The HTTP-server tests (``tests/test_server*.py``) keep uvicorn and per-model worker threads
alive across tests, so tox runs them in a process of their own: ``--suite main`` collects
every other test file, ``--suite server`` only those. Both commands get the same arguments,
so ``tox -- -k losses`` runs each selected test once, in its own process, and a suite whose
selection is all in the other one passes instead of failing with "no tests ran" (a plain run
that collects nothing still fails). Without ``--suite``
everything is collected, as plain ``pytest`` always did.
"""

from __future__ import annotations

import fnmatch

import pytest

SERVER_TESTS = "test_server*.py"


def pytest_addoption(parser):
    parser.addoption("--suite", choices=("main", "server"), default=None,
                     help=f"collect only the HTTP-server tests ({SERVER_TESTS}, 'server') or only the others "
                          "('main'); tox runs the two in separate processes")


def _other_suite(file_name: str, suite: str) -> bool:
    return (suite == "server") != fnmatch.fnmatch(file_name, SERVER_TESTS)


def pytest_ignore_collect(collection_path, config):
    suite = config.getoption("suite")
    name = collection_path.name
    if suite is None or not (name.startswith("test_") and name.endswith(".py")):
        return None
    if _other_suite(name, suite):
        return True  # the other suite's file: not even imported here
    return None


def pytest_collection_modifyitems(config, items):
    """Files named on the command line are collected even when ignored: deselect their tests."""
    suite = config.getoption("suite")
    if suite is None:
        return
    keep, drop = [], []
    for item in items:
        (drop if _other_suite(item.path.name, suite) else keep).append(item)
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
