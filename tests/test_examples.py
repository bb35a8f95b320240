"""examples/: every script runs, in a short mode, the way its docstring says to run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import HANG_S

pytestmark = pytest.mark.slow  # each test runs a script or a server: seconds to minutes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = HANG_S):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, "TINKER_TELEMETRY": "0", **(env or {})})
    return proc


def step_values(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern, text, re.M)]


def test_grpo_script(tmp_path):
    proc = run([sys.executable, str(EXAMPLES / "grpo.py"), "--steps", "2", "--groups", "4", "--group-size", "4",
                "--loss", "ppo", "--lora-rank", "4", "--out", str(tmp_path / "weights")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = step_values(r"^step +\d+  reward ([-+.\d]+)", proc.stdout)
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards), proc.stdout
    assert (tmp_path / "weights" / "config.json").is_file()


def test_loss_plugin_package_installs_and_trains(tmp_path):
    pytest.importorskip("setuptools", reason="the offline build of the example package uses this setuptools")
    source = tmp_path / "loss_plugin"
    shutil.copytree(EXAMPLES / "loss_plugin", source)  # the build writes next to the sources
    site = tmp_path / "site"
    install = run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                   "--target", str(site), str(source)], tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    listed = run([sys.executable, "-m", "skyrl_sdk.cli", "losses", "--json"], tmp_path, env)
    row = next(r for r in json.loads(listed.stdout) if r["name"] == "clipped_pg")
    assert row["plugin"] == "example_loss" and row["config"] == {"max_abs_advantage": 5.0}
    assert row["optional_inputs"] == ["weights", "logprobs"]
    proc = run([sys.executable, str(source / "use_it.py"), "--steps", "2"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("formula ok")
    assert len(step_values(r"^step \d+: reward ([.\d]+)", proc.stdout)) == 2, proc.stdout


def test_cookbook_sl_through_skyrl_sdk_serve(tmp_path):
    pytest.importorskip("tinker_cookbook")
    proc = run([sys.executable, str(EXAMPLES / "cookbook_sl.py"), "--workdir", str(tmp_path / "run"),
                "--conversations", "40", "--batch-size", "8"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "skyrl-sdk serve: listening on http://127.0.0.1:" in proc.stdout
    nll = [float(x) for x in proc.stdout.split("train NLL per step:")[1].split()]
    assert len(nll) == 3 and nll[-1] < nll[0]  # (40 - 10 held out) // 8 steps; it learns


def test_cookbook_sl_on_your_own_server_shows_its_loss_in_the_console(tmp_path):
    """docs/server.md, Console: start ``skyrl-sdk serve``, run the example against it
    (``--base-url``), and the console's loss per token is the train NLL it printed."""
    pytest.importorskip("tinker_cookbook")
    import threading

    import httpx

    from _server_harness import free_port

    model = tmp_path / "tiny-hf"
    assert run([sys.executable, "-c", f"import skyrl_sdk; skyrl_sdk.Backend(model='tiny')"
                f".save_weights_for_sampler({str(model)!r})"], tmp_path).returncode == 0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--model", str(model), "--port",
                               str(port), "--api-key", "tml-local", "--state-dir", str(tmp_path / "state")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        banner = ""
        while "console in a browser" not in banner and server.poll() is None:  # the start-up lines, then the banner
            banner += server.stderr.readline()
        assert f"console in a browser: http://127.0.0.1:{port}/" in banner, banner
        threading.Thread(target=server.stderr.read, daemon=True).start()  # never block on a full pipe
        proc = run([sys.executable, str(EXAMPLES / "cookbook_sl.py"), "--base-url", f"http://127.0.0.1:{port}",
                    "--model", str(model), "--workdir", str(tmp_path / "run"), "--conversations", "40",
                    "--batch-size", "8"], tmp_path, env={"TINKER_API_KEY": "tml-local"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        nll = [float(x) for x in proc.stdout.split("train NLL per step:")[1].split()]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": "tml-local"}) as http:
            (run_,) = http.get("/console/api/runs").json()["runs"]
            curves = http.get(f"/console/api/runs/{run_['model_id']}/curves").json()
        assert curves["step"] == list(range(1, len(nll) + 1))
        # the same numbers (the example prints 3 decimals)
        assert curves["series"]["loss_per_token"]["mean"] == pytest.approx(nll, abs=6e-4) and nll[-1] < nll[0]
    finally:
        server.terminate()
        server.wait(timeout=HANG_S)


def test_fsdp_under_torchrun(tmp_path):
    pytest.importorskip("skyrl_sdk_fsdp")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    proc = run([torchrun, "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "fsdp_torchrun.py"),
                "--steps", "3", "--batch-size", "8", "--device", "cpu", "--out", str(tmp_path / "weights")],
               tmp_path, {"PYTHONFAULTHANDLER": "1"})
    losses = step_values(r"^step +\d+  loss per answer token ([.\d]+)", proc.stdout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rank 0 of 2 drives the training" in proc.stdout
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout
    assert (tmp_path / "weights" / "model.safetensors").is_file()
