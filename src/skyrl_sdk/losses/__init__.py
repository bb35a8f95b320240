"""The loss contract for loss authors, and :func:`evaluate_loss` for model-free use.

Plugin authors normally import these from ``skyrl_sdk`` itself. Engine-side machinery
(resolving a name through a dialect, running a loss on a micro-batch) lives in
:mod:`.resolve` and :mod:`.run` and is not part of this API.
"""

from __future__ import annotations

from .base import LossInput, LossOutput, LossSpec, safe_ratio, segment_mean, segment_sum
from .evaluate import evaluate_loss

__all__ = [
    "LossInput",
    "LossOutput",
    "LossSpec",
    "evaluate_loss",
    "safe_ratio",
    "segment_mean",
    "segment_sum",
]
