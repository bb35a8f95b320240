"""Data and comparison helpers shared by the fsdp engine's tests (a unique module name)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from skyrl_sdk import types

#: One datum per micro-batch on both engines, so that only FSDP (sharding, reduce-scatter,
#: rank split) differs between them: the batching layout itself moves float32 gradients by
#: ~3e-6 (padding width changes the attention kernels' rounding), the tolerance of these
#: tests is 1e-6.
ONE_PER_MICRO_BATCH = {"micro_batch_tokens": 1}

#: Uneven: 51 tokens in 5 datums of different lengths; with 2 ranks the token-balanced
#: split gives 27 and 24 tokens, 2 and 3 datums (so one rank also runs a dummy pass).
LENGTHS = [7, 12, 3, 20, 9]


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the local reference with the ranks' thread count: CPU kernels round differently
    with another number of threads (~3e-6 on these gradients), which is not what we test."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_sft_data(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        weights = (rng.random(n) > 0.3).astype(np.float32)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
        ))
    return data


def make_rl_data(lengths, seed=0, vocab=256, with_logprobs=True):
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        adv = rng.normal(size=n).astype(np.float32)
        adv[: n // 3] = 0.0
        inputs = {"target_tokens": seq[1:], "advantages": adv}
        if with_logprobs:
            inputs["logprobs"] = (-5.8 + 0.3 * rng.normal(size=n)).astype(np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
    return data


def local_grads(backend) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy().copy() for n, p in backend.engine.runner.named_trainable() if p.grad is not None}


def local_weights(backend) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in backend.engine.runner.named_trainable()}


def saved_weights(backend, path: Path) -> dict[str, np.ndarray]:
    """All weights of a Backend of any engine, read back from its save_state files."""
    backend.save_state(path)
    return {k: v.numpy() for k, v in load_file(str(path / "model.safetensors")).items()}


def assert_arrays_close(a: dict, b: dict, atol: float, rtol: float = 0.0, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        torch.testing.assert_close(
            torch.as_tensor(np.asarray(a[k])), torch.as_tensor(np.asarray(b[k])), atol=atol, rtol=rtol,
            msg=lambda m, k=k: f"{what} {k}: {m}",
        )


def assert_outputs_close(out_a, out_b, atol: float) -> None:
    assert len(out_a.loss_fn_outputs) == len(out_b.loss_fn_outputs)
    for i, (x, y) in enumerate(zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs, strict=True)):
        assert x.keys() == y.keys(), i
        for k in x:
            np.testing.assert_allclose(x[k].to_numpy(), y[k].to_numpy(), atol=atol, rtol=0, err_msg=f"datum {i} {k}")


def assert_metrics_close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert abs(a[k] - b[k]) <= atol + rtol * abs(b[k]), (k, a[k], b[k])
