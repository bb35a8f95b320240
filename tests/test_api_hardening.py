"""Careless or hostile calls into the Python API fail with a clear error and change nothing.

Each case is a reproduction from the hardening review (issue 9): before the fix, the call
was silently misread (a float as AdamParams, an int as a LoRA config), leaked an internal
error, or destroyed the weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.testing import make_sft_data, weights_of


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        yield b


def _state(backend):
    return {k: v.clone() for k, v in weights_of(backend).items()}


def _unchanged(before, backend):
    after = weights_of(backend)
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bad", [0.05, "fast", types.SamplingParams(), 3, [1e-4]])
def test_optim_step_refuses_what_is_not_adam_params(backend, bad):
    before = _state(backend)
    backend.forward_backward(make_sft_data([5], seed=3))
    with pytest.raises(TypeError, match=type(bad).__name__):
        backend.optim_step(bad)
    assert _unchanged(before, backend)
    backend.zero_grad()


def test_optim_step_accepts_mapping_and_duck_typed_objects(backend):
    class Duck:
        learning_rate = 0.0
        beta1 = 0.9

    for params in ({"learning_rate": 0.0}, Duck()):
        backend.forward_backward(make_sft_data([5], seed=4))
        out = backend.optim_step(params)
        assert out.metrics["learning_rate"] == 0.0 and out.metrics["skipped"] == 0.0


@pytest.mark.parametrize("bad", [16, "r16", 2.5, [8]])
def test_lora_must_be_a_lora_config(bad):
    with pytest.raises(TypeError, match=type(bad).__name__):
        skyrl_sdk.Backend(model="tiny", lora=bad)


@pytest.mark.parametrize("prompts, match", [
    (["12>"], "prompt 0: expected a ModelInput or a list of token ids, got a string"),
    (types.ModelInput.from_ints([1, 2]), "single ModelInput"),
    ([], "prompts is empty"),
    ([[[1, 2], [3, 4]]], "prompt 0: .*flat list of token ids"),
    ([[1, 2], []], "prompt 1: expected at least one token"),
    ([[1, 1_000_000]], r"prompt 0: token ids must be in \[0, 320\)"),
    (7, "expected a list"),
])
def test_sample_checks_prompts(backend, prompts, match):
    with pytest.raises(errors.InputError, match=match):
        backend.sample(prompts, {"max_tokens": 2})


@pytest.mark.parametrize("params, error, match", [
    (4, TypeError, "int"),
    ("greedy", TypeError, "str"),
    ({"max_tokens": 0}, errors.InputError, "SamplingParams.max_tokens"),
    ({"max_token": 2}, errors.InputError, r"unknown keys \['max_token'\]"),
    ({"temperature": float("inf")}, errors.InputError, "SamplingParams.temperature"),
    ({"stop": [{"x": 1}]}, errors.InputError, r"SamplingParams.stop\[0\]"),
])
def test_sample_checks_sampling_params(backend, params, error, match):
    with pytest.raises(error, match=match):
        backend.sample([[1, 2, 3]], params)


def test_sample_accepts_a_mapping_and_one_stop_string(backend):
    out = backend.sample([types.ModelInput.from_ints([1, 2, 3])], {"max_tokens": 2, "temperature": 0.0})
    assert len(out) == 1 and 1 <= len(out[0].sequences[0].tokens) <= 2
    assert types.SamplingParams(stop="\n").stop == ("\n",)


@pytest.mark.parametrize("tokens", [[[1, 2], [3, 4]], np.ones((2, 2), dtype=np.int64)])
def test_two_dimensional_model_input_is_refused(tokens):
    with pytest.raises(errors.InputError, match=r"flat list of token ids, got shape \[2, 2\]"):
        types.ModelInput.from_ints(tokens)
    with pytest.raises(errors.InputError, match="flat list"):
        types.Datum(model_input=tokens, loss_fn_inputs={"target_tokens": [1, 2, 3, 4]})


@pytest.mark.parametrize("kwargs, match", [
    ({"eps": 1e-50}, "AdamParams.eps"),
    ({"eps": 0.0}, "AdamParams.eps"),
    ({"learning_rate": float("inf")}, "AdamParams.learning_rate"),
    ({"weight_decay": 1e30}, r"learning_rate \* weight_decay must be <= 1"),
    ({"beta1": True}, "AdamParams.beta1"),
    ({"grad_clip_norm": float("nan")}, "AdamParams.grad_clip_norm"),
])
def test_adam_params_that_would_destroy_the_model_are_refused(kwargs, match):
    with pytest.raises(errors.AdamParamsError, match=match):
        types.AdamParams(**kwargs)


def test_a_huge_learning_rate_is_refused_not_applied():
    """lr=3e38 passes validation (finite, >= 0), but the step would overflow: it is refused and
    nothing changes (weights, moments, step counts)."""
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        data = make_sft_data([6, 9], seed=5)
        b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=1e-3))  # moments exist: they must stay as they are
        before = _state(b)
        moments = {k: v.clone() for k, v in b.engine.runner.optimizer.state_items()}
        b.forward_backward(data)
        out = b.optim_step(types.AdamParams(learning_rate=3e38))
        assert out.metrics["skipped"] == 1.0 and out.metrics["nonfinite_update"] == 1.0
        assert out.metrics["step"] == 1.0
        assert _unchanged(before, b)
        after = dict(b.engine.runner.optimizer.state_items())
        assert all(torch.equal(moments[k], after[k]) for k in moments)
        # the next sane step proceeds as if the bad one never happened
        b.forward_backward(data)
        assert b.optim_step(types.AdamParams(learning_rate=1e-3)).metrics["skipped"] == 0.0
        assert all(torch.isfinite(w).all() for w in weights_of(b).values())


def test_optim_step_without_gradients_says_so(backend, caplog):
    backend.zero_grad()
    with caplog.at_level("WARNING"):
        out = backend.optim_step(types.AdamParams(learning_rate=1e-4))
    assert out.metrics["no_gradient"] == 1.0
    assert "without accumulated gradients" in caplog.text
    backend.forward_backward(make_sft_data([4], seed=2))
    assert backend.optim_step(types.AdamParams(learning_rate=0.0)).metrics["no_gradient"] == 0.0


def test_infinite_loss_config_values_are_refused(backend):
    for cfg in ({"beta": float("inf")}, {"beta": float("nan")}, {"beta": True}):
        with pytest.raises(errors.LossConfigError, match="beta"):
            backend.resolve("dro", cfg)


def test_loss_fn_inputs_must_be_a_mapping_of_named_tensors():
    with pytest.raises(errors.InputError, match="loss_fn_inputs: expected a mapping"):
        types.Datum(model_input=[1, 2], loss_fn_inputs=[1, 2])
    with pytest.raises(errors.InputError, match="keys must be non-empty strings"):
        types.Datum(model_input=[1, 2], loss_fn_inputs={1: [1, 2]})
