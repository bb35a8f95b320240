"""The README's test command: ``tox`` runs the two pytest processes (the HTTP-server tests
apart), each selected test once, and a failing command does not hide the other's results."""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from _limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def tox_env() -> configparser.SectionProxy:
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")
    return config["testenv"]


def test_tox_runs_both_suites_with_the_same_arguments_and_keeps_going():
    env = tox_env()
    assert env.getboolean("ignore_errors")  # the server suite runs even when the first one failed
    pytest_commands = [c.strip() for c in env["commands"].splitlines() if "pytest" in c]
    assert pytest_commands == ["python -m pytest -q --suite=main {posargs}",
                               "python -m pytest -q --suite=server {posargs}"]


def test_every_test_file_is_in_exactly_one_suite():
    """The server suite is every ``tests/test_server*.py`` (by name: a new file needs no list
    in tox.ini), the vllm suite the vLLM sampler's tests (they need vLLM), the main suite every
    other test file, the other plugins' included; the ray suite the Ray placement tests (they need
    Ray and vLLM); a run without --suite leaves the vllm and ray ones out."""
    spec = importlib.util.spec_from_file_location("repo_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    def suite_of(path: Path) -> set[str]:
        return {s for s in ("main", "server", "vllm", "ray")
                if not conftest.pytest_ignore_collect(path, SimpleNamespace(getoption=lambda _, s=s: s))}

    files = list((ROOT / "tests").glob("test_*.py")) + list(ROOT.glob("plugins/*/tests/test_*.py"))
    suites = {p.relative_to(ROOT).as_posix(): suite_of(p) for p in files}
    assert {p for p, s in suites.items() if s == {"server"}} == {
        f"tests/{p.name}" for p in (ROOT / "tests").glob("test_server*.py")}
    assert {p for p, s in suites.items() if s == {"vllm"}} == {
        p.relative_to(ROOT).as_posix() for p in ROOT.glob("plugins/skyrl-sdk-vllm/tests/test_*.py")} != set()
    assert {p for p, s in suites.items() if s == {"ray"}} == {
        p.relative_to(ROOT).as_posix() for p in ROOT.glob("plugins/skyrl-sdk-ray/tests/test_*.py")} != set()
    assert all(s in ({"main"}, {"server"}, {"vllm"}, {"ray"}) for s in suites.values()), suites
    plain = SimpleNamespace(getoption=lambda _: None)  # no --suite: everything but the vllm and ray suites
    assert all(bool(conftest.pytest_ignore_collect(ROOT / p, plain)) == (s in ({"vllm"}, {"ray"}))
               for p, s in suites.items())


def collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # four pytest processes
def test_the_suites_split_a_selection_without_overlap():
    """``tox -- -k ...`` (or with file names): each selected test is in exactly one suite, the
    server tests in the server suite; a suite with nothing selected still passes."""
    args = ["-k", "doc or limits", "tests/test_docs.py", "tests/test_server_limits.py", "tests/test_rl_doc.py"]
    everything, main, server = collected(*args), collected("--suite=main", *args), collected("--suite=server", *args)
    assert sorted(main + server) == sorted(everything) and not set(main) & set(server)
    assert main and server and all(re.match(r"tests/test_server\w*\.py::", t) for t in server)
    assert not any("test_server" in t.split("::")[0] for t in main)
    assert collected("--suite=server", "tests/test_docs.py") == []  # exit 0, not "no tests ran"


def _commands(section: str, key: str) -> list[str]:
    """tox's ``key`` of ``section`` as the commands it runs: ``{[env]key}`` references expanded."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")

    def expand(text: str) -> str:
        return re.sub(r"\{\[([\w:]+)\](\w+)\}", lambda m: expand(config[m.group(1)][m.group(2)]), text)

    lines = [line.strip() for line in expand(config[section][key]).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("section", ["testenv", "testenv:vllm", "testenv:ray"])
def test_a_passing_tox_run_prints_no_pip_error(section):
    """After an install *with* dependencies pip checks every installed package's requirements and
    prints ``ERROR: pip's dependency resolver ...`` for tinker-cookbook, installed ``--no-deps``
    (its tml-renderers is on no index): so the ``--no-deps`` install comes after every other. The
    ray environment installs no cookbook at all."""
    installs = [c for c in _commands(section, "commands_pre") if re.search(r"pip install\b", c)]
    no_deps = [i for i, c in enumerate(installs) if "--no-deps" in c]
    if section == "testenv:ray":
        assert installs and not no_deps and "tinker-cookbook" not in " ".join(installs), installs
        return
    assert no_deps and installs[no_deps[0]].endswith("tinker-cookbook==0.6.1")
    assert all("--no-deps" in c for c in installs[no_deps[0]:]), installs
