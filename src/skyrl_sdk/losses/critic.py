"""Critic losses: the clipped value loss (Tinker ``ppo`` on a critic model).

``LossInput.values`` holds the predicted values ``v`` (differentiable); the input ``values``
holds the values ``v_old`` recorded at rollout time and ``returns`` the targets ``R``.
The loss is a plain SUM of ``per_token * mask`` (mask = ``weights``, ones when absent), so it
is exact under any micro-batching. ``scored`` is ``mask != 0``.
"""

from __future__ import annotations

import attrs
import torch

from ..hooks import Register, hookimpl
from ..types.numbers import number_validator
from . import metrics as M
from .base import LossInput, LossOutput


@attrs.frozen
class ValueConfig:
    """``value_clip``: how far (absolute) the new value may move from ``v_old`` before clipping."""

    value_clip: float = attrs.field(default=0.2, validator=number_validator(0.0, low_open=True))


def value(batch: LossInput, config: ValueConfig) -> LossOutput:
    """``0.5 * max((v - R)^2, (v_clip - R)^2)``, ``v_clip = v_old + clamp(v - v_old, +-value_clip)``:
    the pessimistic of the clipped and unclipped errors, as in PPO's value clipping."""
    v = batch.require_values()
    v_old = batch.inputs["values"]
    ret = batch.inputs["returns"]
    mask = batch.mask()
    v_clip = v_old + torch.clamp(v - v_old, -config.value_clip, config.value_clip)
    unclipped = (v - ret) ** 2
    clipped = (v_clip - ret) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    weighted = per_token * mask
    loss = weighted.sum()
    scored = mask != 0
    # Inside the clip range v_clip equals v up to rounding; count only real clipping.
    took_clipped = ((v - v_old).abs() > config.value_clip) & (clipped > unclipped)
    metrics = {
        "vf_loss:sum": M.metric_sum(loss),
        "vf_clip_fraction:mean": M.metric_mean(took_clipped.float(), scored),
        "value_mean:mean": M.metric_mean(v.detach(), scored),
        "num_loss_tokens:sum": M.metric_sum(scored.float()),
    }
    return LossOutput(loss=loss, elementwise_loss=weighted, scored=scored, metrics=metrics)


@hookimpl
def skyrl_sdk_register_losses(register: Register) -> None:
    register(
        "value",
        value,
        description="Clipped value loss, sum(0.5 * max((v-R)^2, (v_clip-R)^2) * weights) (Tinker 'ppo' on a critic).",
        required_inputs=("values", "returns"),
        optional_inputs=("weights", "target_tokens"),
        config_cls=ValueConfig,
        outputs=("values", "elementwise_loss"),
        role="critic",
    )
