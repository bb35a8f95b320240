"""The README's main job, in its short mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_short_mode_trains_and_exports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sdk.cli", "demo", "--short", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["sft_loss_last"] < result["sft_loss_first"]
    weights = Path(result["weights_dir"])
    assert weights.parent == tmp_path.resolve()
    assert (weights / "model.safetensors").is_file() and (weights / "config.json").is_file()
    assert len(result["rl_reward_curve"]) == result["rl_steps"]
