"""Token draws: frequencies follow softmax(logits / T) within top-k / top-p, filtered tokens are
never drawn, the reported logprob is the model's, and a seeded generator reproduces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyrl_sdk.sampling.draw import choose, request_generator
from skyrl_sdk.types import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0, -3.0])
DRAWS = 40_000


def _frequencies(params: SamplingParams, seed: int = 0) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    logits = LOGITS.repeat(DRAWS, 1)
    tokens, logprobs = choose(logits, params, request_generator(seed, torch.device("cpu")))
    return np.bincount(tokens.numpy(), minlength=len(LOGITS)) / DRAWS, tokens, logprobs


def _close(freq: np.ndarray, probs: np.ndarray) -> None:
    """Within 5 standard errors of a multinomial proportion, cell by cell."""
    se = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / DRAWS)
    assert np.all(np.abs(freq - probs) <= 5 * se + 1e-9), (freq, probs)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_the_tempered_softmax(temperature):
    freq, _, _ = _frequencies(SamplingParams(temperature=temperature))
    _close(freq, torch.softmax(LOGITS / temperature, -1).numpy())


def test_top_k_keeps_the_k_most_likely_renormalized():
    freq, _, _ = _frequencies(SamplingParams(top_k=2))
    kept = torch.softmax(LOGITS[:2], -1).numpy()
    _close(freq, np.concatenate([kept, np.zeros(4)]))
    assert freq[2:].sum() == 0


@pytest.mark.parametrize("top_p,kept", [(0.45, 1), (0.75, 2), (0.95, 4), (1.0, 6)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = torch.softmax(LOGITS.double(), -1).numpy()
    assert probs[:kept].sum() >= top_p - 1e-12 and top_p > probs[:kept - 1].sum()  # the nucleus, by hand
    freq, _, _ = _frequencies(SamplingParams(top_p=top_p))
    expected = np.zeros(len(probs))
    expected[:kept] = probs[:kept] / probs[:kept].sum()
    _close(freq, expected)
    assert freq[kept:].sum() == 0


def test_reported_logprob_is_the_models_whatever_the_filters():
    params = SamplingParams(temperature=0.3, top_k=3, top_p=0.8)
    _, tokens, logprobs = _frequencies(params)
    np.testing.assert_allclose(logprobs.numpy(), torch.log_softmax(LOGITS, -1)[tokens].numpy(), atol=1e-6)


def test_greedy_is_argmax_and_reports_the_logprob():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = choose(logits, SamplingParams(temperature=0.0), request_generator(0, torch.device("cpu")))
    assert torch.equal(tokens, logits.argmax(-1))
    np.testing.assert_allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0], atol=1e-6)


def test_zero_probability_tokens_are_never_drawn_even_at_the_edges():
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 1.0, -math.inf]]).repeat(DRAWS, 1)
    tokens, _ = choose(logits, SamplingParams(), request_generator(3, torch.device("cpu")))
    assert set(tokens.tolist()) == {1, 3}


def test_seeded_generator_reproduces_and_seeds_differ():
    params = SamplingParams()
    a = _frequencies(params, seed=7)[1]
    b = _frequencies(params, seed=7)[1]
    c = _frequencies(params, seed=8)[1]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_vanishing_temperature_is_greedy_not_nan():
    """logits / 1e-300 overflows to inf (softmax NaN): such rows take the most likely token."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = choose(logits, SamplingParams(temperature=1e-300), request_generator(0, torch.device("cpu")))
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
