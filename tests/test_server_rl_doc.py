"""docs/rl.md, "Over HTTP": the block runs as written against ``skyrl-sdk serve`` (the tinker
client, stable_reinforce on datums from ``skyrl_sdk.rl.tinker_datum_from_sample``) and learns."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from _server_harness import API_KEY, ServerThread

DOC = Path(__file__).resolve().parents[1] / "docs" / "rl.md"


def over_http_block() -> str:
    section = DOC.read_text().split("## Over HTTP, with the tinker client", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_over_http_block_runs_as_written_and_the_reward_rises(tmp_path, monkeypatch, capsys):
    block = over_http_block()
    assert "tinker_datum_from_sample" in block and '"stable_reinforce"' in block
    with ServerThread(tmp_path / "state") as srv:
        monkeypatch.setenv("TINKER_BASE_URL", srv.url)
        monkeypatch.setenv("TINKER_API_KEY", API_KEY)
        exec(compile(block, "rl.md (Over HTTP)", "exec"), {"__name__": "__main__"})
        assert srv.runtime.sequence_records == {}  # the block closed its session: its records went with it
    rewards = [float(m) for m in re.findall(r"^step +\d+ +mean reward ([-+.\d]+)$", capsys.readouterr().out, re.M)]
    assert len(rewards) == 20, rewards
    assert np.mean(rewards[:3]) < 0.2 and np.mean(rewards[-5:]) > 0.9, rewards  # the doc says 0.02 -> 1.0
