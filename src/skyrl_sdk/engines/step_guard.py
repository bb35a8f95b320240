"""No accepted AdamParams may turn finite weights (or AdamW moments) non-finite, at the cost
of the gradient norm the step computes anyway.

AdamW's update is ``p <- p * (1 - lr*wd) - lr/bc1 * m / (sqrt(v/bc2) + eps)`` with
``m <- b1*m + (1-b1)*g`` and ``v <- b2*v + (1-b2)*g^2``. With ``G >= max|g|`` (the global
L2 norm of the gradients, after clipping, bounds every element) and ``0 <= lr*wd <= 1``
(AdamParams enforces it), three scalars bound a whole optimizer's state from one step to
the next, stepped or not, whatever the other hyper-parameters were before:

    M' = max(M, b1*M + (1-b1)*G)             >= max|m|
    V' = max(V, b2*V + (1-b2)*G^2)           >= max v
    P' = P + lr / (1-b1) * M' / eps          >= max|p|     (|m / (sqrt(v/bc2) + eps)| <= |m| / eps,
                                                             bc1 = 1 - b1^t >= 1 - b1)

So the usual step is proved finite by scalar arithmetic on a :class:`StepBound` carried
from step to step: no pass over the weights or moments, no temporary. When the scalars
cannot clear the dtype's range (the first step, a step after a load, absurd
hyper-parameters or gradients, or a tiny ``eps`` that makes ``M/eps`` loose),
:func:`measure_step` computes the step's exact outcome tensor by tensor, chunk by chunk
(temporaries of at most :data:`CHUNK_ELEMENTS` elements), without changing anything: if it
is finite the step runs and the measured maxima become the new bound, else the step is
refused and the weights, moments and step counts stay as they were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from ..types import AdamParams

#: Elements per chunk when a step is measured: the largest temporary of the check.
CHUNK_ELEMENTS = 2**20
#: Headroom against rounding: every bound must stay below this fraction of the dtype's largest value.
HEADROOM = 0.5
#: Bounds grow by this relative margin per step: float rounding of the step itself.
ROUNDING = 1.0 + 2.0**-7


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (the bounds are elementwise), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@attrs.frozen
class StepBound:
    """Upper bounds on ``max|p|``, ``max|exp_avg|`` and ``max exp_avg_sq`` over every parameter
    of one optimizer (on this rank), and the largest value the narrowest of their dtypes holds."""

    weights: float
    exp_avg: float
    exp_avg_sq: float
    limit: float

    def after(self, adam: AdamParams, grad_max: float) -> StepBound:
        """The bound after one AdamW step with ``adam`` on gradients with ``max|g| <= grad_max``."""
        b1, b2 = adam.beta1, adam.beta2
        m = max(self.exp_avg, b1 * self.exp_avg + (1.0 - b1) * grad_max) * ROUNDING
        v = max(self.exp_avg_sq, b2 * self.exp_avg_sq + (1.0 - b2) * grad_max * grad_max) * ROUNDING
        p = (self.weights + adam.learning_rate / (1.0 - b1) * (m / adam.eps)) * ROUNDING
        return StepBound(p, m, v, self.limit)

    def proves(self, adam: AdamParams) -> bool:
        """Whether this bound (of the step ``adam``, from :meth:`after`) proves the step finite:
        its results and intermediates ``m/eps`` and ``v/bc2`` stay within range (a NaN bound
        proves nothing)."""
        ceiling = self.limit * HEADROOM
        values = (self.weights, self.exp_avg / adam.eps, self.exp_avg_sq / max(1.0 - adam.beta2, 1e-300))
        return all(x < ceiling for x in values)

    def within_range(self) -> bool:
        """Whether measured maxima (from :func:`measure_step`) are finite with headroom."""
        ceiling = self.limit * HEADROOM
        return all(x < ceiling for x in (self.weights, self.exp_avg, self.exp_avg_sq))


def dtype_limit(params: Sequence[torch.Tensor]) -> float:
    """The largest finite value of the narrowest floating dtype among ``params``."""
    return min((float(torch.finfo(p.dtype).max) for p in params), default=float(torch.finfo(torch.float32).max))


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    flat = _local(t).detach().reshape(-1)
    return [flat[i:i + CHUNK_ELEMENTS] for i in range(0, flat.numel(), CHUNK_ELEMENTS)]


def measure_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], adam: AdamParams) -> StepBound:
    """The exact maxima after the AdamW step ``adam`` would make (``params``: all this optimizer
    steps, with gradients or not), computed chunk by chunk in float32 without changing
    anything. A non-finite outcome shows as an infinite or NaN bound."""
    b1, b2, lr, eps = adam.beta1, adam.beta2, adam.learning_rate, adam.eps
    decay = 1.0 - lr * adam.weight_decay
    limit = dtype_limit(params)
    p_max: list[torch.Tensor] = []
    m_max: list[torch.Tensor] = []
    v_max: list[torch.Tensor] = []
    ratio_max: list[torch.Tensor] = []
    for p in params:
        state = optimizer.state.get(p) or {}
        if p.grad is None:  # not stepped: it keeps its values
            p_max += [c.abs().amax().float() for c in _chunks(p) if c.numel()]
            if "exp_avg" in state:
                m_max += [c.abs().amax().float() for c in _chunks(state["exp_avg"]) if c.numel()]
                v_max += [c.amax().float() for c in _chunks(state["exp_avg_sq"]) if c.numel()]
            continue
        step = float(state["step"]) + 1.0 if "step" in state else 1.0
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        if lr / bc1 >= limit * HEADROOM:  # a step size beyond the dtype's range (torch refuses it too)
            return StepBound(math.inf, math.inf, math.inf, limit)
        moments = (_chunks(state["exp_avg"]), _chunks(state["exp_avg_sq"])) if "exp_avg" in state else None
        for i, (pc, gc) in enumerate(zip(_chunks(p), _chunks(p.grad), strict=True)):
            g = gc.float()
            m = g * (1.0 - b1) if moments is None else moments[0][i].float().mul(b1).add_(g, alpha=1.0 - b1)
            v = g * g * (1.0 - b2) if moments is None else moments[1][i].float().mul(b2).addcmul_(g, g, value=1.0 - b2)
            ratio = m / v.div(bc2).sqrt_().add_(eps)
            new_p = pc.float().mul(decay).sub_(ratio, alpha=lr / bc1)
            for out, x in ((p_max, new_p), (m_max, m), (v_max, v), (ratio_max, ratio)):
                if x.numel():
                    out.append(x.abs().amax())

    def top(values: list[torch.Tensor]) -> float:
        return float(torch.stack(values).max()) if values else 0.0  # NaN propagates through max

    largest_ratio = top(ratio_max)
    bound = StepBound(top(p_max), top(m_max), top(v_max), limit)
    if not math.isfinite(largest_ratio) or largest_ratio >= bound.limit * HEADROOM:
        return attrs.evolve(bound, weights=math.inf)
    return bound
