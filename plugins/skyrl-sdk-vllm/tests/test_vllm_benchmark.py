"""The vllm_sampler benchmark's smoke profile runs end to end here, where vLLM is installed (the
default environment's benchmark smoke test sees it "not available"). Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_testutil import HANG_S

REPO = Path(__file__).resolve().parents[3]


def test_the_benchmark_smoke_profile_measures_every_side_and_both_syncs():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--json", "--quiet", "--only",
                           "vllm_sampler"], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)["benchmarks"]["vllm_sampler"]
    assert result["status"] == "ok", result
    t = result["throughput"]
    assert set(t["tokens_per_s"]) == {"vllm_alone", "plugin", "builtin"}
    assert all(s["median"] > 0 for s in t["tokens_per_s"].values())
    assert t["verdict_overhead"] in ("met", "NOT met") and t["sampler"].startswith("vllm 0.")
    kinds = {(r["kind"], r["hidden"]) for r in result["sync"]}
    assert kinds == {("full", 64), ("lora", 64)}
    full, lora = (next(r for r in result["sync"] if r["kind"] == k) for k in ("full", "lora"))
    assert full["bytes"] > 4 * lora["bytes"] > 0  # LoRA pushes the adapter only
