"""Loss reductions (SkyRL/verl ``loss_reduction``) that are exact under any micro-batching.

With ``l`` the per-token loss (already multiplied by the mask ``m`` = ``weights``, ones when
absent; top-K weights are summed over K) and ``B`` datums in the call:

- ``sum``                     : sum_i sum_t l                      (Tinker, the default)
- ``token_mean``              : sum_i sum_t l / sum_i sum_t m
- ``seq_mean_token_mean``     : (1/B) sum_i (sum_t l / sum_t m)
- ``seq_mean_token_sum``      : (1/B) sum_i sum_t l
- ``seq_mean_token_sum_norm`` : (1/B) sum_i sum_t l / max_seq_len  (Dr. GRPO)

Every reduction is linear in ``l`` with a per-token scale that depends on call-level numbers
(``sum_i sum_t m`` and ``B``) and per-datum sums (a datum is never split). The call-level
numbers are computed once from all datums of a call (:func:`call_normalizers`) and handed to
every micro-batch and rank, so micro-batch sums add up to exactly the formula above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import torch

from .base import LossInput, segment_sum

REDUCTIONS = ("sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
#: Reductions that weight each token's loss (``LossOutput.elementwise_loss``) on its own, so a
#: loss must declare ``elementwise_loss`` among its outputs to use them.
PER_TOKEN_REDUCTIONS = ("seq_mean_token_mean",)
#: Which call-level normalizer each reduction uses.
USES_TOKENS = ("token_mean",)
USES_SEQUENCES = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def token_mask(batch: LossInput) -> torch.Tensor:
    """``m`` per position: ``weights`` (summed over K for top-K weights), ones when absent."""
    m = batch.mask()
    return m.sum(dim=-1) if m.dim() == 2 else m


def datum_mask_total(weights: np.ndarray | None, length: int) -> float:
    """``sum_t m`` of one datum from its (optional) weights array."""
    return float(length) if weights is None else float(np.asarray(weights, dtype=np.float64).sum())


def call_normalizers(datums: Sequence) -> tuple[float, float]:
    """``(sum_i sum_t m, B)`` over every datum of a call (``Datum`` objects)."""
    total = 0.0
    for d in datums:
        w = d.loss_fn_inputs.get("weights")
        total += datum_mask_total(None if w is None else w.array, d.model_input.length)
    return total, float(len(datums))


_Scale = TypeVar("_Scale", float, torch.Tensor)


def _inverse(x: _Scale) -> _Scale:
    """``1/x``, and 0 where ``x == 0`` (all-zero masks: the masked loss is 0 there anyway)."""
    if isinstance(x, torch.Tensor):
        return torch.where(x != 0, 1.0 / torch.where(x != 0, x, torch.ones_like(x)), torch.zeros_like(x))
    return 0.0 if x == 0 else 1.0 / x


def token_scale(
    reduction: str,
    batch: LossInput,
    *,
    num_tokens: float | None,
    num_sequences: float | None,
    max_seq_len: int | None,
) -> float | torch.Tensor:
    """The multiplier ``s`` with ``reduced = sum_t l[t] * s[t]``: a float for the uniform
    reductions, a (T,) tensor for ``seq_mean_token_mean``.

    ``num_tokens`` / ``num_sequences`` are the call-level normalizers; ``None`` falls back to
    this LossInput's own counts (exact only when it holds the whole call).
    """
    if reduction == "sum":
        return 1.0
    if reduction == "token_mean":
        if num_tokens is None:
            num_tokens = float(token_mask(batch).sum())
        return _inverse(num_tokens)
    if num_sequences is None:
        num_sequences = float(batch.num_segments)
    per_sequence = _inverse(num_sequences)
    if reduction == "seq_mean_token_sum":
        return per_sequence
    if reduction == "seq_mean_token_sum_norm":
        if max_seq_len is None:
            raise ValueError("loss_reduction 'seq_mean_token_sum_norm' needs max_seq_len")
        return per_sequence / float(max_seq_len)
    if reduction == "seq_mean_token_mean":
        m = token_mask(batch).to(torch.float64)
        per_datum = segment_sum(m, batch.segment_ids, batch.num_segments)
        return (_inverse(per_datum)[batch.segment_ids] * per_sequence).to(torch.float32)
    raise ValueError(f"unknown loss_reduction {reduction!r}; expected one of {list(REDUCTIONS)}")


def reduce_tokens(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``sum_t x[t] * scale[t]`` for a (T,) per-token tensor already multiplied by the mask."""
    if isinstance(scale, torch.Tensor):
        return (x * scale.to(x.dtype)).sum()
    return x.sum() * scale if scale != 1.0 else x.sum()
