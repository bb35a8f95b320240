"""The real vLLM engine in this process leaves the trainer's global generators as they were
(Python's, numpy's, torch's): starting it used to reseed them all to its seed ("The global random
seed is set to 0"), and its unseeded samples drew from torch's. Its own unseeded draws still
continue from call to call."""

from __future__ import annotations

import random

import numpy as np
import torch
from vllm_testutil import SMALL

import skyrl_sdk


def _states():
    return (random.getstate(), np.random.get_state()[1].tobytes(), int(np.random.get_state()[2]),
            torch.get_rng_state().numpy().tobytes())


def test_vllm_leaves_the_trainers_rng_states_as_they_were():
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=SMALL) as b:
        random.seed(1234)
        np.random.seed(1234)
        torch.manual_seed(1234)
        before = _states()
        first = b.sample([list(range(5, 20))], {"max_tokens": 16, "stop": []})[0].sequences[0].tokens  # starts vLLM
        assert _states() == before
        second = b.sample([list(range(5, 20))], {"max_tokens": 16, "stop": []})[0].sequences[0].tokens
        assert _states() == before
        assert first != second  # unseeded: vLLM's own stream goes on
        # and what the trainer draws next is what it would have drawn without vLLM
        mine = (random.random(), np.random.random(), torch.rand(1).item())
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    assert mine == (random.random(), np.random.random(), torch.rand(1).item())
