"""The benchmark suite runs end to end (smoke mode: toy sizes, one repetition) and prints
one valid JSON document with every benchmark and the target table. Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import HANG_S

pytestmark = pytest.mark.slow  # each test runs a script or a server: seconds to minutes

REPO = Path(__file__).resolve().parent.parent
#: every benchmark registered in benchmarks/run.py must run in smoke mode
BENCHMARKS = ["step_time", "peak_memory", "input_path", "server_round_trip", "fsdp", "fsdp_loading", "scaling",
              "sampling", "tenancy", "serve_load", "mixed_precision", "activation_checkpointing", "qwen_0p5b", "grpo",
              "optim_step", "pending_grads", "prefix_sharing", "prefix_memory", "grpo_long_prompts",
              "vllm_sampler", "distributed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory benchmark reads /proc")
def test_smoke_mode_emits_valid_json(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "scaling.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--json", "--quiet", "--plot", str(plot)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # exactly one JSON document on stdout
    assert doc["smoke"] is True
    assert set(doc["benchmarks"]) == set(BENCHMARKS)
    for name, result in doc["benchmarks"].items():
        assert result["status"] == "ok" or result["status"].startswith("not available"), (name, result)
        assert result["seconds"] >= 0

    step = doc["benchmarks"]["step_time"]
    for case in ("variable", "uniform"):
        c = step["cases"][case]
        assert {"sdk_s", "hand_s", "ratio", "cpu_ratio", "target", "verdict"} <= set(c)
        assert c["ratio"]["median"] > 0 and c["ratio"]["min"] <= c["ratio"]["median"] <= c["ratio"]["max"]
        assert c["real_tokens"] <= c["padded_tokens"]
    mem = doc["benchmarks"]["peak_memory"]
    assert mem["sdk_peak_mib"]["median"] >= 0 and mem["hand_peak_mib"]["median"] > 0
    assert 0 <= doc["benchmarks"]["input_path"]["fraction_of_step"]["median"] < 1
    assert 0 <= doc["benchmarks"]["input_path"]["fraction_of_step_from_wire"]["median"] < 1
    for mode in ("full", "lora"):
        c = doc["benchmarks"]["optim_step"]["cases"][mode]
        assert c["ratio"]["median"] > 0 and c["tensors"] > 0 and c["verdict"] in ("met", "NOT met")
    scaling = doc["benchmarks"]["scaling"]
    assert scaling["tokens"] and scaling["seq_len"]
    assert all(r["step_s"]["median"] > 0 for r in scaling["tokens"] + scaling["seq_len"])
    assert doc["plot"] == str(plot) and plot.stat().st_size > 1000

    sampling = doc["benchmarks"]["sampling"]
    assert sampling["sdk_tokens_per_s"]["median"] > 0 and sampling["generate_tokens_per_s"]["median"] > 0
    assert sampling["sdk_peak_growth_gib"] >= 0 and sampling["time_ratio"]["median"] > 0

    load = doc["benchmarks"]["serve_load"]
    if load["status"] == "ok":
        assert load["memory"]["ratio"] > -1 and len(load["memory"]["rss"]) == load["memory"]["clients"]
        assert all(f["small_calls_during"] >= 1 for f in load["fairness"].values())
        assert load["connections"]["healthz"]["polls"] > 0
        assert load["consoles"]["requests"] > 0 and load["consoles"]["healthz"]["polls"] > 0
        assert load["shutdown"]["answers"] and load["bodies"]["statuses"]

    metrics = {(t["benchmark"], t["metric"]) for t in doc["targets"]}
    assert ("step_time", "variable step-time ratio (SDK / hand loop)") in metrics
    assert ("step_time", "uniform step-time ratio (SDK / hand loop)") in metrics
    assert ("peak_memory", "peak-memory ratio (SDK / hand loop)") in metrics
    assert ("input_path", "input path / step time") in metrics
    assert ("sampling", "time ratio (SDK sampler / plain generate)") in metrics
    assert {"server_round_trip", "fsdp"} <= {t["benchmark"] for t in doc["targets"]}
    if doc["benchmarks"]["grpo"]["status"] == "ok":
        assert ("grpo", "RL step-time ratio (backend / TRL GRPOTrainer)") in metrics
    prefix = doc["benchmarks"]["prefix_sharing"]
    assert prefix["headline"]["unique_tokens"] < prefix["headline"]["tokens"]  # the shared side did share
    sweep = doc["benchmarks"]["prefix_memory"]
    assert sweep["cells"] and all(c["shared_rows"] >= 1 for c in sweep["cells"])  # the shared side did share
    assert all(c["shared_peak_mib"]["median"] >= 0 and c["unshared_peak_mib"]["median"] > 0 for c in sweep["cells"])
    assert ("prefix_memory", "peak memory, sharing on / off (worst cell of the sweep)") in metrics
    assert prefix["below_minimum"]["unique_tokens"] == prefix["below_minimum"]["tokens"]  # nothing to share there
    assert all(c["speedup"]["median"] > 0 for c in prefix["prompt_len"] + prefix["group_size"])
    assert ("prefix_sharing", "RL training phase, shared prompts (shared / padded hand loop, CPU)") in metrics
    if doc["benchmarks"]["server_round_trip"]["status"] == "ok":  # the server and the tinker client are here
        served = prefix["through_server"]
        assert served["status"] == "ok" and served["shared_server_cpu_s"]["n"] == served["unshared_server_cpu_s"]["n"]
    if doc["benchmarks"]["grpo_long_prompts"]["status"] == "ok":
        assert {t["metric"] for t in doc["targets"] if t["benchmark"] == "grpo_long_prompts"} == {
            f"RL step-time ratio, long shared prompts ({side} / TRL)" for side in ("backend", "backend_unshared",
                                                                                   "server")}
    for t in doc["targets"]:
        assert {"benchmark", "metric", "target", "verdict"} <= set(t)


def test_grpo_smoke_runs_every_side_and_plots(tmp_path):
    """The GRPO benchmark on its own: three sides, the same steps and samples, a plot."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("trl")
    plot = tmp_path / "grpo.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.grpo", "--smoke", "--steps", "3", "--quiet",
                           "--plot", str(plot)], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["settings"]["steps"] == 3
    assert set(result["sides"]) == {"trl", "backend", "server"}
    for name, side in result["sides"].items():
        assert len(side["reward"]) == 3, name  # one mean reward per step, on every side
        assert all(-10 < r <= 1.0 for r in side["reward"]), name  # the reward's range for 4-token answers
        assert side["step_s"]["n"] == 2 and side["step_s"]["median"] > 0, name  # the first step is warm-up
        assert side["total_s"] >= sum(side["step_s"]["values"]), name
    for name in ("backend", "server"):
        side, trl = result["sides"][name], result["sides"]["trl"]
        assert side["ratio_to_trl"] == pytest.approx(side["step_s"]["median"] / trl["step_s"]["median"])
        assert side["verdict"] == ("met" if side["ratio_to_trl"] <= 0.5 else "NOT met")
    assert result["plot"] == str(plot) and plot.stat().st_size > 1000


def test_grpo_long_prompts_smoke_runs_every_side_and_plots(tmp_path):
    """The long-shared-prompt GRPO benchmark on its own: TRL, ours shared and unshared, through the
    server, a plot."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("trl")
    plot = tmp_path / "grpo_prefix.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.grpo_prefix", "--smoke", "--quiet", "--plot", str(plot)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["status"] == "ok" and result["prompt_tokens"] > result["settings"]["preamble"]
    assert set(result["sides"]) == {"trl", "backend", "backend_unshared", "server"}
    for name, side in result["sides"].items():
        assert len(side["reward"]) == 2 and side["step_s"]["median"] > 0, name
    for name in ("backend", "backend_unshared"):
        side = result["sides"][name]
        assert side["sample_s"]["median"] > 0 and side["train_s"]["median"] > 0
        assert side["ratio_to_trl"] == pytest.approx(side["step_s"]["median"] / result["sides"]["trl"]["step_s"]["median"])
    # seeded sampling: both of our sides draw the same samples, so their rewards agree
    assert result["sides"]["backend"]["reward"] == pytest.approx(result["sides"]["backend_unshared"]["reward"])
    assert result["plot"] == str(plot) and plot.stat().st_size > 1000


def test_grpo_floor_smoke_measures_every_side(tmp_path):
    """The GRPO compute-floor benchmark (toy model, no TRL): every floor and our side timed,
    the prefix-shared floor's gradient equal to the plain one, the step sums consistent."""
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.grpo_floor", "--smoke", "--trl-steps", "0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert {"floor_train_loop", "floor_train_fused", "floor_sample_generate", "floor_sample_loop_peft",
            "ours"} <= set(result["sides"])
    assert result["prefix_shared_grad_max_abs_diff"] < 1e-6
    for name, side in result["sides"].items():
        assert side["total"]["cpu"]["median"] > 0, name
    summary = result["summary"]["cpu"]
    assert 0 < summary["floor_step"] <= summary["floor_step_hf_generate"]
