"""optim_step against a hand-written torch loop: clip_grad_norm_ + torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.models.loading import load_model
from skyrl_sdk.testing import assert_tensors_close, grads_of, make_sft_data, weights_of


def hand_loss(model, data):
    total = 0.0
    for d in data:
        ids = torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(d.loss_fn_inputs["target_tokens"].array).unsqueeze(1)).squeeze(1)
        total = total - (torch.from_numpy(d.loss_fn_inputs["weights"].array) * lp).sum()
    return total


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_optim_step_equals_clip_plus_torch_adamw(clip):
    """Gradients equal a hand-written loss's; the step equals clip_grad_norm_ + AdamW on them.

    The reference optimizer is fed the hand loop's own gradients only after checking they
    match ours, then steps on ours: Adam divides by sqrt(v), which turns 1e-7 noise in a
    near-zero gradient into visible weight noise, so the two halves are checked separately.
    """
    params = types.AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, grad_clip_norm=clip)
    batches = [make_sft_data([6, 11, 4], seed=s) for s in range(3)]
    model = load_model("tiny", seed=0).module
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=params.learning_rate, betas=(params.beta1, params.beta2),
                            eps=params.eps, weight_decay=params.weight_decay)
    with skyrl_sdk.Backend(seed=0) as backend:
        for data in batches:
            opt.zero_grad(set_to_none=True)
            hand_loss(model, data).backward()
            backend.forward_backward(data)
            ours = grads_of(backend)
            assert_tensors_close(ours, {n: p.grad for n, p in named.items()}, atol=1e-5, rtol=1e-4)
            for n, p in named.items():
                p.grad = ours[n].clone()
            max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
            ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            opt.step()
            res = backend.optim_step(params)
            assert res.metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
            assert res.metrics["learning_rate"] == params.learning_rate
            assert res.metrics["skipped"] == 0.0
            # within two float32 ulps: a norm weight near 1.0 has an ulp of 1.2e-7, and the clip
            # coefficient comes from a norm summed in another order than clip_grad_norm_'s
            assert_tensors_close(weights_of(backend), {n: p.detach() for n, p in named.items()}, atol=1e-7, rtol=2.4e-7)


def test_every_adam_field_changes_the_update():
    """Changing any single AdamParams field changes the weights after two steps."""
    data = make_sft_data([8, 5], seed=4)
    base = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    variants = {"learning_rate": 2e-2, "beta1": 0.5, "beta2": 0.5, "eps": 1.0, "weight_decay": 0.5, "grad_clip_norm": 1e-3}

    def train(p):
        with skyrl_sdk.Backend(seed=0) as b:
            for _ in range(2):
                b.forward_backward(data)
                b.optim_step(types.AdamParams(**p))
            return weights_of(b)

    reference = train(base)
    for field, value in variants.items():
        changed = train({**base, field: value})
        diff = max(float((changed[k] - reference[k]).abs().max()) for k in reference)
        assert diff > 1e-6, f"AdamParams.{field} had no effect"


@pytest.mark.parametrize("field, value", [
    ("learning_rate", 1e39), ("learning_rate", 3.4e38), ("learning_rate", 1e-40), ("eps", 1e39),
    ("weight_decay", 1e39), ("grad_clip_norm", 1e300), ("grad_clip_norm", 1e-320),
])
def test_adam_params_out_of_float32_range_are_refused_before_anything_runs(field, value):
    """As a loss config's numbers: a value the step's float32 tensors cannot hold is refused when
    the params are built, naming the field; the pending gradients stay for the next step
    (learning_rate=1e39 used to be accepted, the step skipped as non-finite, the gradients lost)."""
    from skyrl_sdk import errors

    with pytest.raises(errors.AdamParamsError, match=f"AdamParams.{field}: expected 0 or a magnitude in"):
        types.AdamParams(**{field: value})
    with skyrl_sdk.Backend(seed=0) as b:
        b.forward_backward(make_sft_data([6], seed=1))
        pending = grads_of(b)
        with pytest.raises(errors.AdamParamsError):
            b.optim_step({field: value})
        assert_tensors_close(grads_of(b), pending, atol=0)
        assert b.optim_step(types.AdamParams(learning_rate=1e-3)).metrics["skipped"] == 0.0
