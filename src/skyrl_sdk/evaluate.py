"""``evaluate_loss``: one registered loss on one sequence's tensors, without a model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .losses.base import LossInput
from .losses.metrics import MetricAccumulator
from .losses.run import run_loss
from .losses.validation import check_loss_inputs, check_resolved


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
    from .builtin_plugins import get_registry

    registry = get_registry()
    if role is None:
        converted = registry.dialect_spec(dialect).convert(name, config, "policy")
        native = converted[0] if converted else name
        spec = registry.losses.get(native)
        role = spec.role if spec is not None else "policy"
    resolved = registry.resolve(name, config, dialect=dialect, role=role)
    check_resolved(resolved)
    n = int(target_logprobs.shape[0])
    device = target_logprobs.device
    tensors = {}
    for key, value in inputs.items():
        t = torch.as_tensor(value.to_numpy() if hasattr(value, "to_numpy") else value)
        tensors[key] = t.to(device=device, dtype=torch.long if key == "target_tokens" else torch.float32)
    check_loss_inputs(resolved.spec, {k: tuple(v.shape) for k, v in tensors.items()}, n, index=0, need_targets=False,
                      label=resolved.label)
    role = resolved.spec.role
    common = dict(segment_ids=torch.zeros(n, dtype=torch.long, device=device), num_segments=1, entropy=entropy)
    if resolved.spec.prepare is not None:  # whole-call statistics: here the call is this sequence
        detached = LossInput.for_role(role, target_logprobs.detach(), inputs=tensors, **common)
        tensors = {**tensors, **resolved.spec.prepare(detached, resolved.config)}
    loss_input = LossInput.for_role(role, target_logprobs, inputs=tensors, **common)
    out, metrics = run_loss(resolved, loss_input)
    acc = MetricAccumulator()
    acc.add(metrics)
    return out.loss, acc.result()
