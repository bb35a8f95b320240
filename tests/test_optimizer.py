"""The optimizer component (engines/optimizer.py) on its own: steps equal torch's clip + AdamW,
its state round-trips through a file bit for bit, a sharded engine's collectives decide
clipping and the guard, and state loaded from outside is measured again."""

from __future__ import annotations

import torch

from skyrl_sdk import types
from skyrl_sdk.engines.optimizer import MOMENT_KINDS, Optimizer
from skyrl_sdk.models.checkpoint import load_tensors

ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _named(model: torch.nn.Module):
    return lambda: list(model.named_parameters())


def _backward(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=gen)
    (model(x) ** 2).sum().mul(3.0).backward()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_steps_equal_clip_grad_norm_and_torch_adamw():
    ours, ref = _model(), _model()
    opt = Optimizer(_named(ours))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                                eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    for seed in range(3):
        _backward(ours, seed)
        _backward(ref, seed)
        norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), ADAM.grad_clip_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        metrics = opt.step(ADAM)
        assert metrics["skipped"] == 0.0 and metrics["step"] == seed + 1
        assert metrics["grad_norm"] == float(norm) and metrics["grad_norm_clipped"] == ADAM.grad_clip_norm
    assert all(p.grad is None for p in ours.parameters())
    for (name, got), want in zip(_weights(ours).items(), _weights(ref).values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


def test_state_round_trips_through_its_file_bit_for_bit(tmp_path):
    model = _model()
    opt = Optimizer(_named(model))
    for seed in range(2):
        _backward(model, seed)
        opt.step(ADAM)
    opt.save(tmp_path / "optimizer.safetensors")
    saved = load_tensors(tmp_path / "optimizer.safetensors")
    assert sorted(saved) == sorted(f"{n}::{k}" for n, _ in model.named_parameters() for k in MOMENT_KINDS)
    assert all(float(saved[f"{n}::step"]) == 2.0 for n, _ in model.named_parameters())

    copy = _model(seed=1)
    copy.load_state_dict(model.state_dict())
    restored = Optimizer(_named(copy))
    restored.restore(saved, step=2)
    assert restored.step_count == 2
    for (key, a), (_, b) in zip(opt.state_items(), restored.state_items(), strict=True):
        assert torch.equal(a, b), key
    for m in (model, copy):  # the same next step on both: equal bit for bit
        _backward(m, 7)
    opt.step(ADAM)
    restored.step(ADAM)
    for (name, a), b in zip(_weights(model).items(), _weights(copy).values(), strict=True):
        assert torch.equal(a, b), name


def test_release_keeps_the_count_and_reset_starts_over():
    model = _model()
    opt = Optimizer(_named(model))
    _backward(model, 0)
    opt.step(ADAM)
    assert opt.state_bytes() > 0
    opt.release()
    assert (opt.torch_optimizer, opt.state_bytes(), opt.step_count) == (None, 0, 1)
    opt.reset()
    assert opt.step_count == 0 and opt.state_items() == []


def test_empty_state_has_the_full_shapes_a_load_needs():
    model = _model()
    opt = Optimizer(_named(model))
    empty = opt.empty_state({"0.weight": 3.0})
    assert sorted(empty) == ["0.weight::exp_avg", "0.weight::exp_avg_sq", "0.weight::step"]
    assert empty["0.weight::exp_avg"].shape == (7, 5) and float(empty["0.weight::step"]) == 3.0


def test_the_norm_of_all_ranks_decides_the_clipping():
    """A sharded engine passes its global norm: the local gradients are clipped by it."""
    model, ref = _model(), _model()
    _backward(model, 0)
    _backward(ref, 0)
    local = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    global_norm = 4.0 * local  # as if the other ranks' shards held the rest of the gradient
    opt = Optimizer(_named(model), grad_norm=lambda grads: global_norm)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                                eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), ADAM.grad_clip_norm, global_norm)
    ref_opt.step()
    metrics = opt.step(ADAM)
    assert metrics["grad_norm"] == float(global_norm)
    for (name, got), want in zip(_weights(model).items(), _weights(ref).values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


def test_a_step_another_rank_refuses_changes_nothing_here():
    model = _model()
    opt = Optimizer(_named(model), any_rank=lambda flag: True)  # every OR over ranks: "some rank says yes"
    _backward(model, 0)
    before = _weights(model)
    metrics = opt.step(ADAM)
    assert metrics["skipped"] == 1.0 and metrics["nonfinite_update"] == 1.0 and opt.step_count == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_state_loaded_from_outside_is_measured_not_trusted_to_the_old_bound():
    """torch.distributed.checkpoint fills the torch optimizer's state directly: after
    ``state_replaced`` the next step is measured, so moments near the float32 limit refuse
    it instead of the last step's small bound letting it overflow the weights."""
    model = _model()
    opt = Optimizer(_named(model))
    _backward(model, 0)
    opt.step(ADAM)  # measured: a small bound is carried
    for state in opt.torch_optimizer.state.values():  # what a sharded load does
        state["exp_avg"].fill_(3e38)
        state["exp_avg_sq"].fill_(1e-30)
    opt.state_replaced(step=5)
    before = _weights(model)
    _backward(model, 1)
    metrics = opt.step(ADAM)
    assert metrics["skipped"] == 1.0 and opt.step_count == 5
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
