"""Losses: the contract loss authors write against, the built-in losses, and the machinery
that turns a client's ``(loss_fn, loss_fn_config)`` into a computed loss.

- the contract: :mod:`.base` (``LossInput``, ``LossOutput``, ``LossSpec``, segment helpers)
  and :mod:`.metrics` (``Metric`` and its reductions); plugin authors import these from
  ``skyrl_sdk`` itself;
- the built-ins: :mod:`.sft`, :mod:`.policy`, :mod:`.critic`; how client names map onto
  them: :mod:`.dialects`;
- engine-side: :mod:`.resolve` (name + config -> :class:`~.resolve.ResolvedLoss`),
  :mod:`.validation` (a call's datums checked before compute), :mod:`.calls` (a call's data
  on its one way down: made our types, images read, provenance resolved, checked), :mod:`.terms` and
  :mod:`.reduction` (loss_reduction, KL and entropy terms), :mod:`.run` (one micro-batch).
"""

from __future__ import annotations

from .base import LossInput, LossOutput, LossSpec, safe_ratio, segment_mean, segment_sum
from .metrics import Metric, metric_max, metric_mean, metric_min, metric_sum

__all__ = [
    "LossInput",
    "LossOutput",
    "LossSpec",
    "Metric",
    "metric_max",
    "metric_mean",
    "metric_min",
    "metric_sum",
    "safe_ratio",
    "segment_mean",
    "segment_sum",
]
