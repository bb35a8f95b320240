"""``stable_reinforce``: REINFORCE that stays bounded when the sampler differs from the learner.

Tinker names the loss and its promise (stable under off-policy async RL and mismatched
numerics, from information captured at sampling time) but not its formula; docs/losses.md
says what this one computes and why it keeps that promise. Per sampled target token ``t``
(``sampled_mask``, from the datum's provenance, see :mod:`.stability`), with ``q`` the
*recorded* sampler logprob and ``d = clamp(lp - q, -20, 20)``:

    w_t = sg(min(exp(d_t), ratio_cap))               truncated importance weight, in [0, ratio_cap]
    loss_t = -w_t * (A_t - kl_coeff * sg(d_t)) * exp(lp_t - sg(lp_t))

Its gradient per token is ``-w_t (A_t - kl_coeff d_t) grad lp_t``: REINFORCE weighted by a
bounded importance weight (on-policy, ``w = 1``: plain REINFORCE), plus a truncated-IS
estimate of the gradient of ``kl_coeff * KL(learner || sampler)``. However stale the
sampler, no token's coefficient exceeds ``ratio_cap * (|A| + 20 kl_coeff)``; plain
importance sampling's is ``exp(d) |A|``, which grows without bound as the policies part.
"""

from __future__ import annotations

import attrs
import torch

from ..hooks import Register, hookimpl
from ..types.numbers import number_validator
from . import metrics as M
from .base import LOG_RATIO_CLAMP, LossInput, LossOutput
from .stability import SAMPLED_MASK


@attrs.frozen
class StableReinforceConfig:
    """``kl_coeff`` (Tinker's key): weight of the KL(learner || sampler) term, >= 0 (default 0).
    ``ratio_cap``: the largest importance weight a token gets, >= 1 (default 2)."""

    kl_coeff: float = attrs.field(default=0.0, validator=number_validator(0.0))
    ratio_cap: float = attrs.field(default=2.0, validator=number_validator(1.0))


def stable_reinforce(batch: LossInput, config: StableReinforceConfig) -> LossOutput:
    lp = batch.require_target_logprobs()
    q, adv, mask = batch.inputs["logprobs"], batch.inputs["advantages"], batch.mask()
    sampled = batch.inputs[SAMPLED_MASK] != 0
    log_ratio = (lp - q).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=config.ratio_cap)
    # exp(lp - sg(lp)) is 1 with the gradient of lp: the value is the truncated-IS surrogate
    # -w (A - kl_coeff d) (on-policy: importance_sampling's -A), the gradient -w (A - kl_coeff d) grad lp
    unit = torch.exp(lp - lp.detach())
    per_token = torch.where(sampled, -weight * (adv - config.kl_coeff * log_ratio) * unit, torch.zeros_like(lp))
    weighted = per_token * mask
    loss = weighted.sum()
    scored = sampled & (mask != 0)
    metrics = {
        "pg_loss:sum": M.metric_sum(loss),
        "clip_fraction:mean": M.metric_mean((ratio > config.ratio_cap).float(), scored),
        "num_loss_tokens:sum": M.metric_sum(scored.float()),
        "ratio_max:max": M.metric_max(ratio, scored),
        "ratio_min:min": M.metric_min(ratio, scored),
        "ratio_mean:mean": M.metric_mean(ratio, scored),
        "weight_max:max": M.metric_max(weight, scored),
        "kl_sample_train:mean": M.metric_mean(-log_ratio, scored),
    }
    return LossOutput(loss=loss, elementwise_loss=weighted, scored=scored, metrics=metrics,
                      extra_outputs={"importance_weight": torch.where(sampled, weight, torch.zeros_like(weight))})


@hookimpl
def skyrl_sdk_register_losses(register: Register) -> None:
    register(
        "stable_reinforce", stable_reinforce,
        description="StableReinforce: REINFORCE on sampled tokens with a truncated importance weight "
                    "min(r, ratio_cap) against the recorded sampler, plus kl_coeff * KL(learner || sampler).",
        required_inputs=("target_tokens", "advantages", "logprobs", SAMPLED_MASK),
        optional_inputs=("weights",), outputs=("logprobs", "elementwise_loss"),
        config_cls=StableReinforceConfig, role="policy", needs_provenance=True,
    )
