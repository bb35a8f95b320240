"""Activation checkpointing (engine_config gradient_checkpointing): same gradients, blocks recomputed."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.models.activation_checkpointing import enable_activation_checkpointing, transformer_blocks
from skyrl_sdk.testing import assert_outputs_close, grads_of, make_rl_data, make_sft_data, torch_threads

DATA = make_sft_data([24, 31, 17, 40], seed=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _assert_relative(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys() and a
    for name, want in b.items():
        err = float((a[name] - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        assert err <= tol, (name, err)


@pytest.mark.parametrize(
    ("role", "lora", "config", "loss", "data"),
    [
        ("policy", None, {}, "cross_entropy", DATA),
        ("policy", None, {"dtype": "bfloat16"}, "cross_entropy", DATA),
        ("policy", types.LoraConfig(rank=4), {}, "ppo", make_rl_data([19, 28, 9], seed=5)),
        ("policy", None, {"batching": "pack"}, "cross_entropy", DATA),
    ],
    ids=["fp32", "bf16-mixed", "lora-ppo", "packed"],
)
def test_gradients_equal_without_checkpointing(role, lora, config, loss, data):
    results = []
    for checkpointing in (False, True):
        cfg = {**config, "gradient_checkpointing": checkpointing}
        with skyrl_sdk.Backend(model="tiny", role=role, lora=lora, engine_config=cfg) as backend:
            out = backend.forward_backward(data, loss)
            results.append((out, grads_of(backend)))
    (out_plain, grads_plain), (out_ckpt, grads_ckpt) = results
    assert_outputs_close(out_ckpt, out_plain, atol=1e-6)
    _assert_relative(grads_ckpt, grads_plain, 1e-6)


def test_critic_gradients_equal_without_checkpointing():
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "values": np.zeros(d.model_input.length, np.float32), "returns": d.loss_fn_inputs["advantages"],
    }) for d in make_rl_data([11, 23], seed=6, with_logprobs=False)]
    grads = []
    for checkpointing in (False, True):
        with skyrl_sdk.Backend(model="tiny", role="critic",
                               engine_config={"gradient_checkpointing": checkpointing}) as backend:
            backend.forward_backward(data, "value")
            grads.append(grads_of(backend))
    _assert_relative(grads[1], grads[0], 1e-6)


def test_blocks_are_recomputed_in_backward_and_only_then():
    """Each block's inner modules are entered twice per forward_backward (forward + recompute), once
    per forward without gradients; parameter names do not change."""
    with skyrl_sdk.Backend(model="tiny", engine_config={"gradient_checkpointing": True}) as backend:
        module = backend.engine.loaded.module
        blocks = transformer_blocks(module)
        assert len(blocks) == 2
        calls = []
        for i, block in enumerate(blocks):
            block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
        backend.forward_backward(DATA[:1], "cross_entropy")
        assert sorted(calls) == [0, 0, 1, 1]
        calls.clear()
        backend.forward(DATA[:1], "cross_entropy")
        assert sorted(calls) == [0, 1]
        names = [n for n, _ in module.named_parameters()]
        assert not any("checkpoint" in n for n in names)
        assert enable_activation_checkpointing(module) == 2  # idempotent: not wrapped twice
        calls.clear()
        backend.forward_backward(DATA[:1], "cross_entropy")
        assert sorted(calls) == [0, 0, 1, 1]
