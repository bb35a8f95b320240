"""``sampler="vllm"`` over the ``fsdp`` engine: the ranks push the rows of their own shards to the
engine through vLLM's weight-transfer API (the plugin's gloo backend), never through a file;
LoRA pushes its base once and then only the adapter; under torchrun the engine runs in a child
process, so vLLM never touches the job's process group (it used to hang there)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from vllm_testutil import HANG_S, SMALL, forward_logprobs, train, written_under

import skyrl_sdk
import skyrl_sdk_fsdp  # noqa: F401  (this environment installs the fsdp plugin: no silent skip)

PROMPT = list(range(5, 40))


@pytest.fixture
def watched_tmp(tmp_path, monkeypatch):
    """The temporary directory of this process and of the ranks it spawns."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_fsdp_ranks_push_their_shards_and_nothing_touches_disk(watched_tmp, lora):
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2}, lora=lora, sampler="vllm",
                           sampler_config=SMALL) as b:
        for step in range(3):
            if step:  # (step 0 starts the engine, which writes its config and tokenizer files)
                with written_under(watched_tmp) as written:
                    b.sampler.fleet.sync()
                assert not written, f"step {step}: the sync wrote {sorted(written)[:5]}"
            s = b.sample([PROMPT], {"max_tokens": 8, "seed": 1})[0].sequences[0]
            np.testing.assert_allclose(s.logprobs, forward_logprobs(b, PROMPT, s.tokens), atol=1e-3)
            if step:
                sync = b.sampler.last_sync
                assert sync["kind"] == ("lora" if lora else "full") and sync["version"] == b.sampler.source.version
                assert sync["seconds"] > 0
            train(b, steps=1)
        assert "weights pushed: gloo" in b.sampler.describe()
        layout = b.sampler.source.push_layout("float32")
        assert layout.ranks == 2
        sharded = [t for t in layout.tensors if all(b > a for a, b in t.rows)]
        assert sharded, "no tensor is sent by both ranks: they do not send from their shards"


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import skyrl_sdk_fsdp
    skyrl_sdk_fsdp.worker_main()
    import skyrl_sdk
    sys.path.insert(0, sys.argv[2])
    from vllm_testutil import SMALL, forward_logprobs, train
    P = list(range(5, 40))
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", sampler="vllm", sampler_config=SMALL) as b:
        diffs = []
        for step in range(2):
            s = b.sample([P], {"max_tokens": 8, "seed": 1})[0].sequences[0]
            diffs.append(float(np.abs(np.array(s.logprobs) - forward_logprobs(b, P, s.tokens)).max()))
            train(b, steps=1)
        where = b.sampler.describe()
    with open(sys.argv[1], "w") as f:
        json.dump({"diffs": diffs, "where": where}, f)
""")


@pytest.mark.slow
def test_fsdp_and_vllm_under_torchrun_train_and_sample(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path / "out.json"),
                           str(Path(__file__).parent)], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert max(result["diffs"]) < 1e-3
    assert "child process" in result["where"]
