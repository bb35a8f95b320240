"""The torchrun launch path: ranks come from the launcher, rank 0 runs the script as controller."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("skyrl_sdk_fsdp")

from fsdp_testutil import LENGTHS, ONE_PER_MICRO_BATCH, saved_weights

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.testing import assert_tensors_close, make_sft_data, torch_threads

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ADAM = dict(learning_rate=1e-2, grad_clip_norm=50.0)

# The same script runs on every rank. ``worker_main()`` returns on rank 0 and serves rank 0
# on the other ranks (then exits); the second script relies on Backend() doing the same.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    EXPLICIT = sys.argv[2] == "explicit"
    if EXPLICIT:
        import skyrl_sdk_fsdp
        skyrl_sdk_fsdp.worker_main()
        assert os.environ["RANK"] == "0"
    import skyrl_sdk
    from skyrl_sdk import types
    sys.path.insert(0, sys.argv[3])
    from fsdp_testutil import LENGTHS, ONE_PER_MICRO_BATCH  # noqa: E402
    from skyrl_sdk.testing import make_sft_data  # noqa: E402

    out_dir = sys.argv[1]
    data = make_sft_data(LENGTHS, seed=31)
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config=dict(ONE_PER_MICRO_BATCH)) as backend:
        assert os.environ["RANK"] == "0", "ranks != 0 never get past Backend()"
        results = []
        for _ in range(2):
            out = backend.forward_backward(data)
            metrics = backend.optim_step(types.AdamParams(**%(adam)r)).metrics
            results.append({"loss": out.metrics["loss:sum"], "grad_norm": metrics["grad_norm"]})
        backend.save_state(os.path.join(out_dir, "state"))
        results.append({"world_size": backend.engine.world_size, "launcher": backend.engine.launcher})
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(results, f)
    """
) % {"adam": ADAM}


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize("style", ["explicit", "implicit"])
def test_torchrun_two_ranks_match_local(tmp_path, style):
    import fsdp_testutil

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    helper_dir = str(fsdp_testutil.__file__).rsplit("/", 1)[0]
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path), style, helper_dir],
        capture_output=True, text=True, timeout=fsdp_testutil.HANG_S, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]  # docs/engines.md: the exit abort is fixed
    results = json.loads((tmp_path / "result.json").read_text())
    assert results[-1] == {"world_size": 2, "launcher": "torchrun"}
    with torch_threads(1):
        local = skyrl_sdk.Backend(model="tiny", engine_config=ONE_PER_MICRO_BATCH)
        data = make_sft_data(LENGTHS, seed=31)
        for got in results[:2]:
            out = local.forward_backward(data)
            metrics = local.optim_step(types.AdamParams(**ADAM)).metrics
            assert got["loss"] == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        from safetensors.torch import load_file

        theirs = {k: v.numpy() for k, v in load_file(str(tmp_path / "state" / "model.safetensors")).items()}
        assert_tensors_close(theirs, saved_weights(local, tmp_path / "local"), atol=5e-5, what="weights")
        local.close()


def test_torchrun_without_launcher_env_is_an_input_error(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(skyrl_sdk.errors.InputError, match="torchrun"):
        skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"launcher": "torchrun"})
    assert sys.modules.get("skyrl_sdk_fsdp") is not None
