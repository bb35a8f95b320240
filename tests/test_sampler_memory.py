"""Bounded memory: sampling a 32k-vocabulary model never holds (rows x steps x vocab) logits.

Peak RSS is read from ``VmHWM`` after resetting it through ``/proc/self/clear_refs`` (see
docs/performance.md). The model is tiny (hidden 32, one layer) so the vocabulary dominates.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

from skyrl_sdk.sampling import generate
from skyrl_sdk.types import SampleRequest, SamplingParams

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

VOCAB, PROMPTS, SAMPLES, STEPS = 32000, 2, 4, 64
ALL_LOGITS_MIB = PROMPTS * SAMPLES * STEPS * VOCAB * 4 / 2**20  # 62.5 MiB in float32


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_growth_mib(run) -> float:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    run()
    return (_status("VmHWM") - base) / 2**20


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


@pytest.mark.slow
def test_sampling_a_32k_vocabulary_keeps_memory_bounded(model):
    prompts = [np.arange(1, 9), np.arange(100, 105)]
    params = SamplingParams(max_tokens=STEPS, seed=0, stop=[])

    def sample():
        out = generate(model, None, SampleRequest(prompts=prompts, sampling_params=params, num_samples=SAMPLES),
                       device=torch.device("cpu"), eos_token_id=None, pad_token_id=0)
        assert all(len(s.tokens) == STEPS for o in out for s in o.sequences)

    sample()  # warm-up: lazy allocations are not the sampler's
    growth = _peak_growth_mib(sample)  # measured: ~2 MiB
    # the measurement sees a (rows x steps x vocab) float32 buffer when one is made
    materialized = _peak_growth_mib(lambda: torch.ones(PROMPTS * SAMPLES, STEPS, VOCAB).sum())
    assert materialized > 0.9 * ALL_LOGITS_MIB
    assert growth < ALL_LOGITS_MIB / 4, f"sampling grew the peak RSS by {growth:.1f} MiB"
