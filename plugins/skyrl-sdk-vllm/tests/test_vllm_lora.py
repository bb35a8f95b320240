"""``sampler="vllm"`` with LoRA: only the adapter goes to vLLM, from memory, as a new adapter
version after each step; the LoRA clients of one shared base share one engine and one copy of
the base; a version kept by a snapshot sampler stays what it was."""

from __future__ import annotations

import numpy as np
import pytest
from vllm_testutil import SMALL, forward_logprobs, mirror, train

import skyrl_sdk
from skyrl_sdk_vllm import engines

PROMPT = list(range(5, 40))


def _check(backend, seed=1, num_samples=2):
    """Every sample's logprobs are the Backend's ``forward`` (the adapter in use is the current one)."""
    for s in backend.sample([PROMPT], {"max_tokens": 8, "seed": seed}, num_samples=num_samples)[0].sequences:
        np.testing.assert_allclose(s.logprobs, forward_logprobs(backend, PROMPT, s.tokens), atol=1e-3)


def test_a_lora_model_samples_its_current_adapter(tmp_path):
    with skyrl_sdk.Backend(model="tiny", lora={"rank": 4}, seed=3, sampler="vllm", sampler_config=SMALL) as b, \
            skyrl_sdk.Backend(model="tiny", lora={"rank": 4}, seed=3) as ref:
        _check(b)
        first = b.sampler.last_sync
        assert first["kind"] == "lora" and first["version"] == 0
        train(b)
        _check(b)
        pushed = b.sampler.last_sync
        adapter_bytes = sum(p.numel() * 4 for n, p in b.engine.loaded.module.named_parameters() if "lora_" in n)
        assert (pushed["kind"], pushed["version"], pushed["bytes"]) == ("lora", 2, adapter_bytes)
        assert len(b.sampler.engine.adapters) == 1  # the previous version was dropped
        # prompt logprobs with an adapter on the output head (train_unembed): the built-in sampler's
        mirror(ref, b, tmp_path / "state")
        ask = {"prompt_logprobs": True, "topk_prompt_logprobs": 2}
        got, want = (x.sample([PROMPT, [4, 5, 6]], {"max_tokens": 2}, num_samples=2, **ask) for x in (b, ref))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.prompt_logprobs[1:], w.prompt_logprobs[1:], atol=1e-4)
            assert [[t for t, _ in k] for k in g.topk_prompt_logprobs[1:]] == \
                [[t for t, _ in k] for k in w.topk_prompt_logprobs[1:]]
        greedy = {"max_tokens": 10, "temperature": 0.0}
        assert b.sample([PROMPT], greedy)[0].sequences[0].tokens == ref.sample([PROMPT], greedy)[0].sequences[0].tokens


def test_clients_of_a_shared_base_share_one_engine_and_keep_their_own_versions():
    """Two clients and the base itself on one engine; with room for one adapter in vLLM
    (max_cpu_loras=1) every switch drops the other's, which comes back from memory. A snapshot
    sampler (what the server builds for save_weights_and_get_sampling_client) is one more
    adapter version on the same engine, and keeps sampling the version it was made from."""
    from skyrl_sdk.server.compute.snapshots import load_snapshot, take_snapshot

    config = {**SMALL, "max_loras": 1, "max_cpu_loras": 1}
    with skyrl_sdk.SharedBase(model="tiny") as base:
        opts = {"sampler": "vllm", "sampler_config": config}
        alice, bob = base.backend({"rank": 4}, seed=1, **opts), base.backend({"rank": 8}, seed=2, **opts)
        reader = base.base_backend(**opts)
        running = engines.engines_running()
        for _ in range(2):
            for client in (alice, bob, reader):
                _check(client)
        assert engines.engines_running() == running + 1  # the engine the first one started
        assert alice.sampler.engine is bob.sampler.engine is reader.sampler.engine
        assert alice.sampler.engine.max_lora_rank == 64
        snap = take_snapshot("alice", alice, 2**30)
        snapshot = base.backend({"rank": 4}, seed=1, **opts)
        load_snapshot(snapshot, snap.tensors)
        pinned = snapshot.sample([PROMPT], {"max_tokens": 8, "seed": 9})[0].sequences[0]
        train(alice)
        train(bob, steps=1)
        for client in (alice, bob, reader):
            _check(client)
        again = snapshot.sample([PROMPT], {"max_tokens": 8, "seed": 9})[0].sequences[0]
        assert again.tokens == pinned.tokens
        np.testing.assert_allclose(again.logprobs, pinned.logprobs, atol=1e-5)
        assert alice.sample([PROMPT], {"max_tokens": 8, "seed": 9})[0].sequences[0].logprobs != pinned.logprobs
        held = set(alice.sampler.engine.adapters) - {engines.NULL_ADAPTER}  # the base's stand-in on CPU aside
        assert len(held) == 3  # alice's, bob's and the snapshot's current versions
        for client in (snapshot, alice, bob, reader):
            client.close()
        assert engines.engines_running() == running  # the last user closed it


def test_a_rank_above_the_engines_is_refused_by_name():
    with skyrl_sdk.SharedBase(model="tiny") as base:
        opts = {"sampler": "vllm", "sampler_config": {**SMALL, "max_lora_rank": 8}}
        small, big = base.backend({"rank": 8}, **opts), base.backend({"rank": 16}, **opts)
        small.sample([PROMPT], {"max_tokens": 1})
        with pytest.raises(skyrl_sdk.errors.InputError, match=r"LoRA rank 16 is above this vLLM engine's "
                                                              r"max_lora_rank 8 \(set sampler_config"):
            big.sample([PROMPT], {"max_tokens": 1})
        big.close()
        small.close()
