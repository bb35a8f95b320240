"""No accepted AdamParams may turn finite weights non-finite.

AdamW's update is ``p <- p * (1 - lr*wd) - lr/bc1 * m / (sqrt(v/bc2) + eps)``, and
``|m / (sqrt(v/bc2) + eps)| <= |m| / eps``. So with finite gradients

    max|p_new| <= max|p| * |1 - lr*wd| + lr/bc1 * max|m_new| / eps,
    max|m_new| <= beta1 * max|m| + (1 - beta1) * max|g|,

and when that bound stays below half the dtype's largest value the step is provably
finite: it runs as is (three max-reductions per tensor, no copy). Only a step the bound
cannot clear (absurd hyper-parameters or gradients) is taken on a snapshot, checked, and
rolled back if any weight or moment became non-finite (or torch refused the step midway).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from ..types import AdamParams


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (the bound is elementwise), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _max_abs(tensors: Sequence[torch.Tensor]) -> list[float]:
    """max |x| of each tensor (0 for an empty one: a rank's shard of a small tensor can be empty)."""
    local = [_local(t).detach() for t in tensors]
    filled = [i for i, t in enumerate(local) if t.numel()]
    out = [0.0] * len(local)
    if filled:
        norms = torch._foreach_norm([local[i].float() for i in filled], ord=float("inf"))
        for i, norm in zip(filled, norms, strict=True):
            out[i] = float(norm)
    return out


def step_is_provably_finite(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], adam: AdamParams) -> bool:
    """Whether the AdamW step about to run on ``params`` (all with finite grads) cannot overflow."""
    if not params:
        return True
    p_max = _max_abs(params)
    g_max = _max_abs([p.grad for p in params])
    decay = abs(1.0 - adam.learning_rate * adam.weight_decay)
    for i, p in enumerate(params):
        state = optimizer.state.get(p) or {}
        m_max = _max_abs([state["exp_avg"]])[0] if "exp_avg" in state else 0.0
        step = float(state["step"]) + 1.0 if "step" in state else 1.0
        bias1 = 1.0 - adam.beta1 ** step
        m_new = adam.beta1 * m_max + (1.0 - adam.beta1) * g_max[i]
        bound = p_max[i] * decay + adam.learning_rate / bias1 * m_new / adam.eps
        if not bound < torch.finfo(p.dtype).max / 2:
            return False
    return True


def all_finite(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    """Every weight and AdamW moment of ``params`` is finite (rank-local)."""
    tensors = list(params)
    for p in params:
        state = optimizer.state.get(p) or {}
        tensors += [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
    return all(bool(torch.isfinite(_local(t)).all()) for t in tensors)


def guarded_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    adam: AdamParams,
    any_rank: Callable[[bool], bool] = lambda flag: flag,
) -> bool:
    """Run ``optimizer.step()``; return False (and change nothing) if it would make a weight
    or moment non-finite. ``any_rank`` ORs a flag over ranks (sharded engines)."""
    if not any_rank(not step_is_provably_finite(optimizer, params, adam)):
        optimizer.step()
        return True
    saved_params = [_local(p).detach().clone() for p in params]
    saved_state = {p: copy.deepcopy(optimizer.state[p]) for p in params if p in optimizer.state}
    try:
        optimizer.step()
        ok = all_finite(optimizer, params)
    except RuntimeError:  # e.g. torch refusing a step size beyond float range, mid-step
        ok = False
    if not any_rank(not ok):
        return True
    with torch.no_grad():
        for p, old in zip(params, saved_params, strict=True):
            _local(p).copy_(old)
    for p in params:
        if p in saved_state:
            optimizer.state[p] = saved_state[p]
        else:
            optimizer.state.pop(p, None)
    return False
