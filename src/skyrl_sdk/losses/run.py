"""Running a resolved loss (engine-side; not part of the author API): on one micro-batch
(:func:`run_loss`), and a loss's ``prepare`` step over a whole call (:func:`add_prepared_inputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..errors import PluginError
from ..types import Datum
from .base import LossInput, LossOutput, scores_key
from .metrics import Metric, check_metric_key
from .resolve import ResolvedLoss
from .terms import apply_terms, elementwise_loss_problem


def _malformed(resolved: ResolvedLoss, problem: str) -> PluginError:
    return PluginError(f"loss {resolved.name!r} (plugin {resolved.plugin or 'unknown'!r}) {problem}")


def run_loss(resolved: ResolvedLoss, loss_input: LossInput) -> tuple[LossOutput, dict[str, Metric]]:
    """Run a resolved loss on one (micro-)batch; returns (LossOutput, metrics dict of Metric).

    Adds the metrics every call reports: ``loss:sum``, ``total_loss:sum``,
    ``entropy_loss:sum`` (when entropy is known). Malformed output is the plugin's fault,
    not the caller's: it raises :class:`~skyrl_sdk.errors.PluginError` naming the plugin.
    """
    if resolved.scores_only:  # a critic's values read without targets: no loss to compute
        return LossOutput(loss=loss_input.scores().new_zeros(())), {}
    out = resolved.spec.fn(loss_input, resolved.config)
    if not isinstance(out, LossOutput):
        raise _malformed(resolved, f"returned {type(out).__name__}, expected LossOutput")
    if not isinstance(out.loss, torch.Tensor) or out.loss.dim() != 0:
        shape = tuple(out.loss.shape) if isinstance(out.loss, torch.Tensor) else type(out.loss).__name__
        raise _malformed(resolved, f"returned a loss that is not a scalar tensor: {shape}")
    problem = elementwise_loss_problem(resolved.terms, loss_input, out)
    if problem:
        raise _malformed(resolved, problem)
    out = apply_terms(resolved.name, resolved.terms, loss_input, out)  # reduction, KL, entropy terms
    metrics = dict(out.metrics)
    for key, value in metrics.items():
        try:
            check_metric_key(key)
        except ValueError as exc:
            raise _malformed(resolved, f"reported a bad metric: {exc}") from None
        if not isinstance(value, Metric):
            raise _malformed(resolved, f"reported metric {key!r} as {type(value).__name__}, expected Metric")
    loss_value = out.loss.detach()  # read with the call's other metrics, after its last micro-batch
    metrics["loss:sum"] = Metric(loss_value)
    metrics["total_loss:sum"] = Metric(loss_value)
    if loss_input.entropy is not None:
        ent = loss_input.entropy.detach()
        if out.scored is not None:
            ent = ent * out.scored.to(ent.dtype)
        metrics["entropy_loss:sum"] = Metric(ent.sum())
    return out, metrics


def add_prepared_inputs(
    datums: Sequence[Datum], resolved: ResolvedLoss, outputs: Sequence[Mapping[str, np.ndarray]]
) -> list[Datum]:
    """Pack the call, run ``resolved.spec.prepare`` on it, and split its results per datum.

    ``outputs`` are the per-datum results of a no-grad pass over ``datums`` (``logprobs`` for
    a policy, ``values`` for a critic).
    """
    role = resolved.spec.role
    lengths = [d.model_input.length for d in datums]
    scores = torch.from_numpy(np.concatenate([o[scores_key(role)] for o in outputs]))
    inputs = {
        k: torch.from_numpy(np.concatenate([d.loss_fn_inputs[k].array for d in datums]))
        for k in datums[0].loss_fn_inputs
    }
    segment_ids = torch.from_numpy(np.repeat(np.arange(len(datums)), lengths))
    packed = LossInput.for_role(role, scores, inputs=inputs, segment_ids=segment_ids, num_segments=len(datums))
    assert resolved.spec.prepare is not None  # called only for a loss with a prepare step
    extra = resolved.spec.prepare(packed, resolved.config)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [
        Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs,
                            **{k: v.detach().cpu().numpy()[bounds[i]:bounds[i + 1]] for k, v in extra.items()}},
        )
        for i, d in enumerate(datums)
    ]
