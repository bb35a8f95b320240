"""Shared fixtures: small random datasets for the built-in tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skyrl_sdk import types

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def make_sft_data(lengths, seed=0, vocab=256, shifted=False):
    """Datums with random tokens; targets are random (not the shifted input) unless ``shifted``."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        targets = seq[1:] if shifted else rng.integers(0, vocab, n)
        weights = (rng.random(n) > 0.3).astype(np.float32)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": targets, "weights": weights},
        ))
    return data


def make_rl_data(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        adv = rng.normal(size=n).astype(np.float32)
        adv[: n // 3] = 0.0  # prompt positions
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={
                "target_tokens": seq[1:],
                "logprobs": (-5.8 + 0.3 * rng.normal(size=n)).astype(np.float32),
                "advantages": adv,
            },
        ))
    return data


@pytest.fixture
def sft_data():
    return make_sft_data([7, 12, 3, 20, 9], seed=1)


def grads_of(backend) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in backend.engine.runner.named_trainable() if p.grad is not None}


def weights_of(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.engine.runner.named_trainable()}


def assert_tensors_close(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")
