"""Supervised loss: weighted cross-entropy (also top-K distillation targets)."""

from __future__ import annotations

from ..hooks import Register, hookimpl
from . import metrics as M
from .base import LossInput, LossOutput


def cross_entropy(batch: LossInput, config: None) -> LossOutput:
    """``-sum(w * lp)``; with (N, K) targets and weights the sum runs over all N*K entries."""
    lp = batch.require_target_logprobs()
    w = batch.inputs.get("weights")
    if w is None:
        w = lp.new_ones(lp.shape)
    per_entry = -(w * lp)
    elementwise = per_entry if per_entry.dim() == 1 else per_entry.sum(dim=-1)
    scored = (w != 0) if w.dim() == 1 else (w != 0).any(dim=-1)
    return LossOutput(
        loss=per_entry.sum(),
        elementwise_loss=elementwise,
        scored=scored,
        metrics={"num_loss_tokens:sum": M.metric_sum(scored.float())},
    )


@hookimpl
def skyrl_sdk_register_losses(register: Register) -> None:
    register(
        "cross_entropy",
        cross_entropy,
        description="Weighted negative log-likelihood, -sum(weights * logprobs); top-K targets allowed.",
        required_inputs=("target_tokens",),
        optional_inputs=("weights",),
        outputs=("logprobs", "elementwise_loss"),
        accepts_topk_targets=True,
    )
