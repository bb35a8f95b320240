"""The plugin's README: its Python block runs as pasted (CPU or GPU: the tiny model, sampled
by vLLM, trained, sampled again with the new weights); the install lines are checked with the
other plugins' (tests/test_plugin_readmes.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vllm_testutil import HANG_S

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_python_block_runs_as_pasted(tmp_path):
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    script = tmp_path / "readme.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = eval(proc.stdout.strip().splitlines()[-1])  # the last sample's tokens, printed as a list
    assert isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
