"""Built-in losses, the loss contract, and :func:`evaluate_loss` for model-free use."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .base import LossInput, LossOutput, LossSpec, safe_ratio, segment_mean, segment_sum
from .resolve import ResolvedLoss, build_config, resolve_loss

__all__ = [
    "LossInput",
    "LossOutput",
    "LossSpec",
    "ResolvedLoss",
    "build_config",
    "evaluate_loss",
    "resolve_loss",
    "run_loss",
    "safe_ratio",
    "segment_mean",
    "segment_sum",
]


def run_loss(resolved: ResolvedLoss, loss_input: LossInput):
    """Run a resolved loss on one (micro-)batch; returns (LossOutput, metrics dict of Metric).

    Adds the metrics every call reports: ``loss:sum``, ``total_loss:sum``,
    ``entropy_loss:sum`` (when entropy is known) and checks the loss's metric keys.
    """
    from ..metrics import Metric, check_metric_key

    out = resolved.spec.fn(loss_input, resolved.config)
    if not isinstance(out, LossOutput):
        raise TypeError(f"loss {resolved.name!r} returned {type(out).__name__}, expected LossOutput")
    if out.loss.dim() != 0:
        raise ValueError(f"loss {resolved.name!r} returned a non-scalar loss of shape {tuple(out.loss.shape)}")
    metrics = dict(out.metrics)
    for key in metrics:
        check_metric_key(key)
    loss_value = float(out.loss.detach())
    metrics["loss:sum"] = Metric(loss_value)
    metrics["total_loss:sum"] = Metric(loss_value)
    if loss_input.entropy is not None:
        ent = loss_input.entropy
        if out.scored is not None:
            ent = ent * out.scored.to(ent.dtype)
        metrics["entropy_loss:sum"] = Metric(float(ent.sum()))
    return out, metrics


def evaluate_loss(
    name: str,
    target_logprobs: torch.Tensor,
    inputs: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    dialect: str = "native",
    *,
    role: str | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run one registered loss on one sequence's 1-D tensors, without a model.

    ``target_logprobs`` is the (N,) (or (N, K)) tensor the loss differentiates; for a
    critic loss it holds the predicted values. ``inputs`` maps loss_fn_inputs keys to
    tensors, lists or arrays aligned to the N positions (``target_tokens`` is not needed).
    Gradients flow to ``target_logprobs``. Returns ``(loss, metrics)``.
    """
    from ..metrics import MetricAccumulator
    from ..plugins import get_registry
    from ..validation import check_loss_inputs

    registry = get_registry()
    if role is None:
        converted = registry.dialects[dialect].convert(name, config, "policy") if dialect in registry.dialects else None
        canonical = converted[0] if converted else name
        spec = registry.losses.get(canonical)
        role = spec.role if spec is not None else "policy"
    resolved = resolve_loss(registry, name, config, dialect=dialect, role=role)
    n = int(target_logprobs.shape[0])
    device = target_logprobs.device
    tensors = {}
    for key, value in inputs.items():
        t = torch.as_tensor(value.to_numpy() if hasattr(value, "to_numpy") else value)
        tensors[key] = t.to(device=device, dtype=torch.long if key == "target_tokens" else torch.float32)
    check_loss_inputs(resolved.spec, {k: tuple(v.shape) for k, v in tensors.items()}, n, index=0, need_targets=False,
                      label=resolved.label)
    main = "values" if resolved.spec.role == "critic" else "target_logprobs"
    common = dict(segment_ids=torch.zeros(n, dtype=torch.long, device=device), num_segments=1, entropy=entropy)
    if resolved.spec.prepare is not None:  # whole-call statistics: here the call is this sequence
        detached = LossInput(inputs=tensors, **common, **{main: target_logprobs.detach()})
        tensors = {**tensors, **resolved.spec.prepare(detached, resolved.config)}
    loss_input = LossInput(inputs=tensors, **common, **{main: target_logprobs})
    out, metrics = run_loss(resolved, loss_input)
    acc = MetricAccumulator()
    acc.add(metrics)
    return out.loss, acc.result()
