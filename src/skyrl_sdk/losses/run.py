"""Running a resolved loss on one micro-batch (engine-side; not part of the author API)."""

from __future__ import annotations

import torch

from ..errors import PluginError
from ..metrics import Metric, check_metric_key
from .base import LossInput, LossOutput
from .resolve import ResolvedLoss
from .terms import apply_terms


def _malformed(resolved: ResolvedLoss, problem: str) -> PluginError:
    return PluginError(f"loss {resolved.name!r} (plugin {resolved.plugin or 'unknown'!r}) {problem}")


def run_loss(resolved: ResolvedLoss, loss_input: LossInput) -> tuple[LossOutput, dict[str, Metric]]:
    """Run a resolved loss on one (micro-)batch; returns (LossOutput, metrics dict of Metric).

    Adds the metrics every call reports: ``loss:sum``, ``total_loss:sum``,
    ``entropy_loss:sum`` (when entropy is known). Malformed output is the plugin's fault,
    not the caller's: it raises :class:`~skyrl_sdk.errors.PluginError` naming the plugin.
    """
    out = resolved.spec.fn(loss_input, resolved.config)
    if not isinstance(out, LossOutput):
        raise _malformed(resolved, f"returned {type(out).__name__}, expected LossOutput")
    if not isinstance(out.loss, torch.Tensor) or out.loss.dim() != 0:
        shape = tuple(out.loss.shape) if isinstance(out.loss, torch.Tensor) else type(out.loss).__name__
        raise _malformed(resolved, f"returned a loss that is not a scalar tensor: {shape}")
    out = apply_terms(resolved.name, resolved.terms, loss_input, out)  # reduction, KL, entropy terms
    metrics = dict(out.metrics)
    for key, value in metrics.items():
        try:
            check_metric_key(key)
        except ValueError as exc:
            raise _malformed(resolved, f"reported a bad metric: {exc}") from None
        if not isinstance(value, Metric):
            raise _malformed(resolved, f"reported metric {key!r} as {type(value).__name__}, expected Metric")
    loss_value = float(out.loss.detach())
    metrics["loss:sum"] = Metric(loss_value)
    metrics["total_loss:sum"] = Metric(loss_value)
    if loss_input.entropy is not None:
        ent = loss_input.entropy.detach()
        if out.scored is not None:
            ent = ent * out.scored.to(ent.dtype)
        metrics["entropy_loss:sum"] = Metric(float(ent.sum()))
    return out, metrics
