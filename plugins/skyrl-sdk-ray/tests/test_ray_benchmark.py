"""The distributed benchmark's smoke profile runs end to end here, where vLLM and Ray are installed
(the default environment's benchmark smoke test sees it "not available"). Not a timing test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "skyrl-sdk-vllm" / "tests"))
from vllm_testutil import HANG_S

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_the_smoke_profile_measures_syncs_rollout_and_overlap():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--json", "--quiet", "--only",
                           "distributed"], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)["benchmarks"]["distributed"]
    assert result["status"] == "ok", result
    sync = result["sync"][0]
    assert sync["bytes"] > 0 and sync["gloo_push"]["n"] == sync["temp_export"]["n"] == 1
    assert set(result["rollout"]["tokens_per_s"]) == {"1_engines", "2_engines"}
    assert all(s["median"] > 0 for s in result["rollout"]["tokens_per_s"].values())
    assert set(result["overlap"]) == {"overlap", "no_overlap"}
