"""The README's main job, in its short mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import HANG_S

pytestmark = pytest.mark.slow  # each test runs a script or a server: seconds to minutes


def test_demo_short_mode_trains_and_exports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sdk.cli", "demo", "--short", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["sft_loss_last"] < result["sft_loss_first"]
    weights = Path(result["weights_dir"])
    assert weights.parent == tmp_path.resolve()
    assert (weights / "model.safetensors").is_file() and (weights / "config.json").is_file()
    assert len(result["rl_reward_curve"]) == result["rl_steps"]
    assert result["cpu_threads"] >= 1


def test_demo_says_what_it_does_shows_progress_and_what_next(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a fresh shell
    proc = subprocess.run(
        [sys.executable, "-m", "skyrl_sdk.cli", "demo", "--short", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=HANG_S, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("skyrl-sdk demo: teach the built-in tiny model")
    assert "reverse digit strings" in out and "reward: " in out and "accuracy: " in out
    assert "12 supervised steps" in out and "2 RL steps" in out  # --short's numbers, not the defaults
    assert "\n  torch: 1 CPU thread (the default on CPU; --threads N to change)\n" in out  # README: Running on CPU
    weights = str(tmp_path.resolve() / "sampler_weights")
    assert f"from_pretrained({weights!r})" in out and f"skyrl-sdk serve --model {weights}" in out
    assert "docs/rl.md" in out
    assert "supervised: 100%" in proc.stderr and "rl: 100%" in proc.stderr  # tqdm, without -v or a TTY
    assert "Warning" not in proc.stderr and "Traceback" not in proc.stderr


def test_readme_tour_runs_twice_in_the_same_directory(tmp_path, monkeypatch):
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    tour = re.search(r"## 30-second tour\n\n```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        exec(compile(tour, "README.md", "exec"), {})
    assert (tmp_path / "exported" / "model.safetensors").is_file()


#: the import names of what the extras (``[lora]``, ``[vision]``, ``[server]``, ``[test]``, ``[bench]``) add
EXTRAS_MODULES = ("peft", "PIL", "fastapi", "uvicorn", "tinker", "google.protobuf", "httpx", "pytest", "hypothesis",
                  "matplotlib", "psutil", "trl", "datasets", "pandas", "pyarrow")
WITHOUT_EXTRAS = """
import sys
for name in sys.argv[1].split(","):  # as if not installed: import fails, find_spec says None
    sys.modules[name] = None
from skyrl_sdk.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_the_readmes_first_line_installs_only_what_the_demo_needs(tmp_path):
    """README line 1 installs the package without extras or plugins, and the demo runs with
    none of the extras' modules importable (as after that install in a fresh venv)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].splitlines()[0]
    install, run = first.split(" && ")
    assert install.split() == ["pip", "install", "torch==2.13.0", "-e", "."] and run == "skyrl-sdk demo"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, ",".join(EXTRAS_MODULES), "demo", "--short", "--json",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["sft_loss_last"] < json.loads(proc.stdout)["sft_loss_first"]
    check = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, ",".join(EXTRAS_MODULES), "serve"],
                           capture_output=True, text=True, timeout=HANG_S)  # the blocking works:
    assert check.returncode == 2 and 'pip install -e ".[server]"' in check.stderr, check.stderr
