"""The optimizer step's guarantee (no accepted AdamParams turns finite weights or moments
non-finite) and its price: the usual step is proved finite by scalar arithmetic, and agrees
with torch's own AdamW."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.engines import optimizer as optimizer_module
from skyrl_sdk.engines import step_guard
from skyrl_sdk.engines.step_guard import StepBound, measure_step
from skyrl_sdk.testing import make_sft_data, weights_of


def _counting(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return measure_step(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "measure_step", spy)
    return calls


def test_steps_match_torch_adamw_and_only_the_first_is_measured(monkeypatch):
    measured = _counting(monkeypatch)
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        runner = b.engine.runner
        names = [n for n, _ in runner.named_trainable()]
        ref = {n: p.detach().clone().requires_grad_() for n, p in runner.named_trainable()}
        ref_opt = torch.optim.AdamW(list(ref.values()), lr=1e-3, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1)
        for step in range(3):
            b.forward_backward(make_sft_data([6, 9], seed=step))
            for n, p in runner.named_trainable():
                ref[n].grad = p.grad.clone()
            torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
            ref_opt.step()
            out = b.optim_step(types.AdamParams(learning_rate=1e-3, weight_decay=0.1, grad_clip_norm=0.5))
            assert out.metrics["skipped"] == 0.0
        got = weights_of(b)
        for n in names:
            torch.testing.assert_close(got[n], ref[n].detach(), atol=1e-6, rtol=1e-5)
    assert len(measured) == 1  # the first step (no bound yet); the next two by scalar arithmetic


def test_loaded_moments_are_measured_again(monkeypatch, tmp_path):
    measured = _counting(monkeypatch)
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        data = make_sft_data([5], seed=1)
        b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        b.save_state(tmp_path / "s")
        b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        assert len(measured) == 1
        b.load_state(tmp_path / "s")
        b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        assert len(measured) == 2


def test_a_tiny_eps_step_is_measured_and_runs():
    """eps = float32's smallest normal number makes the scalar bound useless (m/eps overflows);
    the measured step is finite and runs."""
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        for step in range(2):
            b.forward_backward(make_sft_data([6], seed=step))
            out = b.optim_step(types.AdamParams(learning_rate=1e-3, eps=types.MIN_ADAM_EPS))
            assert out.metrics["skipped"] == 0.0
        assert all(torch.isfinite(w).all() for w in weights_of(b).values())


def _adamw_copy(params, grads, states, adam):
    """A real torch AdamW step on copies, as the reference outcome."""
    copies = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(copies, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                            weight_decay=adam.weight_decay)
    for c, g, state in zip(copies, grads, states, strict=True):
        c.grad = g.clone()
        if state is not None:
            opt.state[c] = {k: v.clone() for k, v in state.items()}
    opt.step()
    return copies, opt


def _setup(seed, n, scale, with_state):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n,), (3, n), (1,)]
    params = [torch.randn(s, generator=gen) * scale for s in shapes]
    grads = [torch.randn(s, generator=gen) * scale for s in shapes]
    states = [{"step": torch.tensor(float(seed % 5 + 1)), "exp_avg": torch.randn(s, generator=gen) * scale,
               "exp_avg_sq": torch.rand(s, generator=gen) * scale * scale} if with_state else None for s in shapes]
    return params, grads, states


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3, 1e12]),
       lr=st.sampled_from([0.0, 1e-6, 1e-3, 1.0, 10.0]), beta1=st.sampled_from([0.0, 0.5, 0.9, 0.999]),
       beta2=st.sampled_from([0.0, 0.9, 0.999]), eps=st.sampled_from([1e-30, 1e-12, 1e-8, 1.0]),
       wd=st.sampled_from([0.0, 0.1]), with_state=st.booleans())
def test_the_scalar_bound_holds_for_a_real_adamw_step(seed, n, scale, lr, beta1, beta2, eps, wd, with_state):
    """From any bound that holds before a step (and any betas: they may change between
    steps), StepBound.after holds after torch's AdamW step."""
    adam = types.AdamParams(learning_rate=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=min(wd, 1 / max(lr, 1)))
    params, grads, states = _setup(seed, n, scale, with_state)
    before = StepBound(
        weights=max(float(p.abs().max()) for p in params),
        exp_avg=max((float(s["exp_avg"].abs().max()) for s in states if s), default=0.0),
        exp_avg_sq=max((float(s["exp_avg_sq"].max()) for s in states if s), default=0.0),
        limit=float(torch.finfo(torch.float32).max),
    )
    grad_max = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))  # the L2 norm bounds every element
    after = before.after(adam, grad_max)
    if not after.proves(adam):
        return  # the runner measures such a step instead (tested below)
    copies, opt = _adamw_copy(params, grads, states, adam)
    assert max(float(c.detach().abs().max()) for c in copies) <= after.weights
    assert max(float(opt.state[c]["exp_avg"].abs().max()) for c in copies) <= after.exp_avg
    assert max(float(opt.state[c]["exp_avg_sq"].max()) for c in copies) <= after.exp_avg_sq


@pytest.mark.parametrize("chunk", [step_guard.CHUNK_ELEMENTS, 7])
@pytest.mark.parametrize("with_state", [False, True])
def test_measure_step_predicts_the_real_step_and_changes_nothing(monkeypatch, chunk, with_state):
    monkeypatch.setattr(step_guard, "CHUNK_ELEMENTS", chunk)
    params, grads, states = _setup(3, 20, 1.0, with_state)
    adam = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1)
    live = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(live, lr=0.0)
    for p, g, state in zip(live, grads, states, strict=True):
        p.grad = g.clone()
        if state is not None:
            opt.state[p] = {k: v.clone() for k, v in state.items()}
    frozen = [p.detach().clone() for p in live]
    got = measure_step(opt, live, adam)
    assert all(torch.equal(p.detach(), f) for p, f in zip(live, frozen, strict=True))  # nothing changed
    copies, ref = _adamw_copy(params, grads, states, adam)
    assert got.weights == pytest.approx(max(float(c.detach().abs().max()) for c in copies), rel=1e-5)
    assert got.exp_avg == pytest.approx(max(float(ref.state[c]["exp_avg"].abs().max()) for c in copies), rel=1e-5)
    assert got.exp_avg_sq == pytest.approx(max(float(ref.state[c]["exp_avg_sq"].max()) for c in copies), rel=1e-5)
    assert got.within_range()


def test_measure_step_sees_an_overflow_and_empty_shards():
    p = torch.tensor([1.0, -2.0]).requires_grad_()
    empty = torch.zeros(0).requires_grad_()  # a rank's shard of a small tensor can be empty
    p.grad, empty.grad = torch.tensor([1.0, 1.0]), torch.zeros(0)
    opt = torch.optim.AdamW([p, empty], lr=0.0)
    assert measure_step(opt, [p, empty], types.AdamParams(learning_rate=1e-3)).within_range()
    assert not measure_step(opt, [p, empty], types.AdamParams(learning_rate=3e38)).within_range()
    p.grad = torch.tensor([3e38, 1.0])  # g^2 overflows the second moment
    assert not measure_step(opt, [p, empty], types.AdamParams(learning_rate=1e-3)).within_range()
