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


#: Elements whose ``|x|`` copies exist at once while measuring (64 MiB of float32): the
#: foreach kernels are ~5x faster than ``_foreach_norm(inf)`` on CPU but need the copies.
_GROUP_ELEMENTS = 2**24


def _max_abs(tensors: Sequence[torch.Tensor]) -> list[float]:
    """max |x| of each tensor (0 for an empty one: a rank's shard of a small tensor can be empty)."""
    local = [_local(t).detach() for t in tensors]
    filled = [i for i, t in enumerate(local) if t.numel()]
    maxes: list[torch.Tensor] = []
    group: list[torch.Tensor] = []
    size = 0
    for i in filled:
        group.append(local[i])
        size += local[i].numel()
        if size >= _GROUP_ELEMENTS or i == filled[-1]:
            maxes += torch._foreach_max(torch._foreach_abs(group))
            group, size = [], 0
    out = [0.0] * len(local)
    if filled:
        for i, value in zip(filled, torch.stack([m.float() for m in maxes]).tolist(), strict=True):  # one host sync
            out[i] = value
    return out


def step_is_provably_finite(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], adam: AdamParams) -> bool:
    """Whether the AdamW step about to run on ``params`` (all with finite grads) cannot overflow."""
    if not params:
        return True
    p_max = _max_abs(params)
    g_max = _max_abs([p.grad for p in params])
    states = [optimizer.state.get(p) or {} for p in params]
    with_moments = [i for i, state in enumerate(states) if "exp_avg" in state]
    m_maxes = dict(zip(with_moments, _max_abs([states[i]["exp_avg"] for i in with_moments]), strict=True))
    counted = [i for i, state in enumerate(states) if "step" in state]
    # one optimizer keeps every step counter on one device: one host sync for all of them
    step_values = torch.stack([torch.as_tensor(states[i]["step"], dtype=torch.float64).reshape(())
                               for i in counted]).tolist() if counted else []
    steps = dict(zip(counted, step_values, strict=True))
    decay = abs(1.0 - adam.learning_rate * adam.weight_decay)
    for i, p in enumerate(params):
        m_max = m_maxes.get(i, 0.0)
        step = steps.get(i, 0.0) + 1.0
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
