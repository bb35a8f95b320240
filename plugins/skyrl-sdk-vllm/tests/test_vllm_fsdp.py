"""``sampler="vllm"`` over the ``fsdp`` engine: full fine-tuning goes through the weights the
ranks export (a temporary directory per sync: the slow path, but right); a LoRA model is
refused by name (its ranks hand out no base apart from the adapters)."""

from __future__ import annotations

import numpy as np
import pytest
from vllm_testutil import SMALL, forward_logprobs, train

import skyrl_sdk
import skyrl_sdk_fsdp  # noqa: F401  (this environment installs the fsdp plugin: no silent skip)

PROMPT = list(range(5, 40))


@pytest.mark.slow
def test_full_fine_tuning_under_fsdp_samples_its_current_weights():
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2}, sampler="vllm",
                           sampler_config=SMALL) as b:
        for step in range(2):
            s = b.sample([PROMPT], {"max_tokens": 8, "seed": 1})[0].sequences[0]
            np.testing.assert_allclose(s.logprobs, forward_logprobs(b, PROMPT, s.tokens), atol=1e-3)
            assert (b.sampler.last_sync is None) == (step == 0)
            if step:  # the whole wait: the ranks' export (most of it) as well as vLLM's load
                sync = b.sampler.last_sync
                assert sync["fetch_seconds"] > 0 and sync["load_seconds"] > 0
                assert sync["seconds"] >= sync["fetch_seconds"] + sync["wake_seconds"] + sync["load_seconds"]
            train(b)
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2}, lora={"rank": 4},
                           sampler="vllm", sampler_config=SMALL) as lora:
        with pytest.raises(skyrl_sdk.errors.InputError, match="the fsdp engine cannot hand a sampler its LoRA "
                                                              "model's base weights"):
            lora.sample([PROMPT], {"max_tokens": 1})
