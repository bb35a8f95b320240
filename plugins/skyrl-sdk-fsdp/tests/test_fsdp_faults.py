"""A rank that dies or raises gives a clear EngineError quickly; no process outlives its owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("skyrl_sdk_fsdp")
psutil = pytest.importorskip("psutil")

from fsdp_testutil import HANG_S

import skyrl_sdk
from skyrl_sdk.errors import DatumError, EngineError, LossConfigError, PluginError
from skyrl_sdk.testing import fresh_plugins, make_sft_data, plugin_site  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: "bounded time": a failure surfaces well before the 1800 s collective timeout would end a
#: hang; generous, so a loaded machine never fails it (idle: about a second)
BOUND_S = 600.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, timeout=HANG_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _backend():
    return skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2})


def test_killed_worker_gives_clear_error_and_no_orphans():
    backend = _backend()
    pids = backend.engine.rank_pids
    data = make_sft_data([5, 8, 3], seed=1)
    backend.forward_backward(data)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"rank 1 died \(killed by signal SIGKILL\)"):
        backend.forward_backward(data)
    assert time.monotonic() - start < BOUND_S
    # the engine says why it cannot go on, instead of hanging on the survivors
    with pytest.raises(EngineError, match="unusable after an earlier failure"):
        backend.optim_step()
    backend.close()
    assert _wait_gone(pids) == []


@pytest.mark.parametrize("mode,cause", [("raise", "rank 1 raised RuntimeError: injected failure"),
                                        ("exit", "rank 1 exited with code 3")])
def test_rank_failing_mid_collective(mode, cause):
    """Rank 1 fails while rank 0 waits for it inside a collective: no hang, the cause named first."""
    backend = _backend()
    pids = backend.engine.rank_pids
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        backend.engine.debug_fail(1, mode)
    assert time.monotonic() - start < BOUND_S
    message = str(info.value)
    assert message.startswith(f"fsdp engine: debug_fail failed: {cause}"), message
    assert "create a new Backend" in message
    assert _wait_gone(pids) == []  # the stuck rank 0 was stopped right away
    backend.close()


MALFORMED_LOSS = """
    import skyrl_sdk

    def fn(batch, config):
        return {"loss": -batch.target_logprobs.sum()}   # a dict, not a LossOutput

    @skyrl_sdk.hookimpl
    def skyrl_sdk_register_losses(register):
        register("fsdp_malformed", fn, description="returns a dict",
                 required_inputs=("target_tokens",), optional_inputs=("weights",))
"""


def test_plugin_fault_on_the_ranks_arrives_as_plugin_error(fresh_plugins, plugin_site):  # noqa: F811
    """A loss plugin's malformed output, raised on every rank, reaches the caller as the
    PluginError naming the loss and its plugin (not a generic EngineError)."""
    plugin_site("skyrl-fsdp-malformed", {"skyrl_fsdp_malformed": MALFORMED_LOSS},
                {"malformed": "skyrl_fsdp_malformed"})
    backend = _backend()
    pids = backend.engine.rank_pids
    with pytest.raises(PluginError, match=r"loss 'fsdp_malformed' \(plugin 'malformed'\) returned dict") as info:
        backend.forward_backward(make_sft_data([5, 8, 3], seed=1), "fsdp_malformed")
    assert not isinstance(info.value, EngineError) and "create a new Backend" in str(info.value)
    with pytest.raises(EngineError, match="unusable after an earlier failure: loss 'fsdp_malformed'"):
        backend.optim_step()
    backend.close()
    assert _wait_gone(pids) == []


def test_bad_input_is_refused_before_any_rank_computes():
    """Issue 21: what is knowable is checked on the controller (the model's positions come from
    the ranks' EngineInfo), so the engine and its pending gradients stay as they were."""
    import numpy as np

    from skyrl_sdk.testing import make_rl_data

    backend = _backend()
    assert backend.engine.info.max_positions == 2048
    backend.forward_backward(make_sft_data([5, 8, 3], seed=1))
    before = backend.engine.gradients()
    with pytest.raises(DatumError, match="2049 tokens; this model accepts at most 2048"):
        backend.forward_backward(make_sft_data([4, 2049], seed=2))
    with pytest.raises(LossConfigError, match="clip_high_threshold"):
        backend.forward_backward(make_rl_data([4], seed=2), "ppo", {"clip_high_threshold": 1e308})
    after = backend.engine.gradients()
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    assert backend.optim_step().metrics["num_forward_backward_calls"] == 1.0
    backend.close()


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import skyrl_sdk
    backend = skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2})
    print("PIDS", *backend.engine.rank_pids, flush=True)
    if sys.argv[1] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)   # the controller dies without any cleanup
    # "exit": the interpreter exits without close()
    """
)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphans_when_controller_exits_or_dies(tmp_path, how):
    script = tmp_path / "controller.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=HANG_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PIDS")]
    assert lines, proc.stderr[-2000:]
    pids = [int(p) for p in lines[0].split()[1:]]
    assert len(pids) == 2
    assert _wait_gone(pids) == []
