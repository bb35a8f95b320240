"""Policy-gradient losses (native SkyRL names): the math of docs/losses.md.

Conventions shared by every loss here:

- ``lp`` = target logprobs (differentiable), ``q`` = input ``logprobs`` (sampler),
  ``A`` = ``advantages``, ``mask`` = ``weights`` (ones when absent).
- ``ratio = exp(clamp(lp - q, -20, 20))`` (:func:`safe_ratio`); where the clamp is active the
  ratio is constant, so its gradient is zero.
- The loss is a plain SUM over tokens of ``per_token * mask``; ``elementwise_loss`` is that
  product (differentiable, so reductions can weight it per sequence), and
  ``elementwise_loss.sum() == loss``.
- ``scored`` (the positions the loss scores, used for metrics and ``entropy_loss:sum``):
  ``weights != 0`` when weights are sent; otherwise ``advantages != 0``, because Tinker
  clients mark prompt positions with ``advantages = 0`` and send no weights. ``dro`` is the
  exception: its KL term makes every position contribute, so without weights it scores all.
- Per-token ``clip_low_threshold`` / ``clip_high_threshold`` inputs (regular, dual_clip,
  gspo, cispo) are ABSOLUTE ratio bounds that replace the config's bounds for that token.
  They are used as sent (no range check at loss time).
- Metrics over scored tokens: ``pg_loss:sum``, ``clip_fraction:mean`` (tokens where a clip
  was active; 0 for losses that never clip), ``ratio_max:max``, ``ratio_min:min``,
  ``ratio_mean:mean``, ``kl_sample_train:mean`` (mean of ``q - lp``, the k1 estimate of
  KL(sampler || learner)), ``num_loss_tokens:sum``, plus loss-specific keys.
"""

from __future__ import annotations

import math

import attrs
import torch

from ..hooks import Register, hookimpl
from ..types.numbers import number_validator
from . import metrics as M
from .base import LossInput, LossOutput, safe_ratio, segment_mean

RL_REQUIRED = ("target_tokens", "logprobs", "advantages")
THRESHOLD_INPUTS = ("clip_low_threshold", "clip_high_threshold")
OUTPUTS = ("logprobs", "elementwise_loss")


# ---- config validation ------------------------------------------------------------------


def _eps_low(default: float) -> float:
    """A lower clip offset: the lower ratio bound ``1 - eps`` must lie in [0, 1]."""
    return attrs.field(default=default, validator=number_validator(0.0, 1.0))


def _eps_high(default: float) -> float:
    return attrs.field(default=default, validator=number_validator(0.0))


@attrs.frozen
class PPOConfig:
    """``regular`` and ``gspo``: clip offsets, bounds ``[1 - eps_clip_low, 1 + eps_clip_high]``."""

    eps_clip_low: float = _eps_low(0.2)
    eps_clip_high: float = _eps_high(0.2)


@attrs.frozen
class DualClipConfig:
    eps_clip_low: float = _eps_low(0.2)
    eps_clip_high: float = _eps_high(0.2)
    clip_ratio_c: float = attrs.field(default=3.0, validator=number_validator(1.0, low_open=True))


@attrs.frozen
class CispoConfig:
    """Default bounds [0, 5]: CISPO clips the (detached) IS weight only from above in practice."""

    cispo_eps_clip_low: float = _eps_low(1.0)
    cispo_eps_clip_high: float = _eps_high(4.0)


@attrs.frozen
class SapoConfig:
    tau_pos: float = attrs.field(default=1.0, validator=number_validator(0.0, low_open=True))
    tau_neg: float = attrs.field(default=1.05, validator=number_validator(0.0, low_open=True))


@attrs.frozen
class DroConfig:
    beta: float = attrs.field(default=0.1, validator=number_validator(0.0))


@attrs.frozen
class ClipCovConfig:
    clip_ratio: float = attrs.field(default=0.0002, validator=number_validator(0.0, 1.0))
    clip_cov_lb: float = attrs.field(default=1.0, validator=number_validator())
    clip_cov_ub: float = attrs.field(default=5.0, validator=number_validator())
    eps_clip_low: float = _eps_low(0.2)
    eps_clip_high: float = _eps_high(0.2)
    seed: int = attrs.field(default=0, validator=number_validator(integer=True))

    def __attrs_post_init__(self) -> None:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb ({self.clip_cov_lb}) must be smaller than clip_cov_ub ({self.clip_cov_ub})"
            )


@attrs.frozen
class KLCovConfig:
    kl_cov_ratio: float = attrs.field(default=0.0002, validator=number_validator(0.0, 1.0))
    ppo_kl_coef: float = attrs.field(default=1.0, validator=number_validator(0.0))


# ---- shared pieces ------------------------------------------------------------------------


def _rl_inputs(batch: LossInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(lp, q, A, mask, has_weights) for a ratio-based loss."""
    lp = batch.require_target_logprobs()
    return lp, batch.inputs["logprobs"], batch.inputs["advantages"], batch.mask(), "weights" in batch.inputs


def _scored(batch: LossInput) -> torch.Tensor:
    """``weights != 0`` when weights are sent, else ``advantages != 0`` (see module doc)."""
    w = batch.inputs.get("weights")
    return (w != 0) if w is not None else (batch.inputs["advantages"] != 0)


def _bounds(batch: LossInput, eps_low: float, eps_high: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute ratio bounds per token: the per-token inputs if sent, else the config's."""
    lo = batch.inputs.get("clip_low_threshold")
    hi = batch.inputs.get("clip_high_threshold")
    if lo is None:
        lo = torch.full_like(like, 1.0 - eps_low)
    if hi is None:
        hi = torch.full_like(like, 1.0 + eps_high)
    return lo.to(like.dtype), hi.to(like.dtype)


def _ppo(ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor,
         hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip per-token loss ``max(-A*r, -A*clamp(r))`` and where the clipped term won."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, lo, hi)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _ratio_metrics(ratio: torch.Tensor, lp: torch.Tensor, q: torch.Tensor, scored: torch.Tensor) -> dict[str, M.Metric]:
    r = ratio.detach()
    return {
        "ratio_max:max": M.metric_max(r, scored),
        "ratio_min:min": M.metric_min(r, scored),
        "ratio_mean:mean": M.metric_mean(r, scored),
        "kl_sample_train:mean": M.metric_mean((q - lp).detach(), scored),
    }


def _finish(per_token: torch.Tensor, mask: torch.Tensor, scored: torch.Tensor, *, ratio: torch.Tensor, lp: torch.Tensor,
            q: torch.Tensor, clipped: torch.Tensor | None = None,
            extra_metrics: dict[str, M.Metric] | None = None) -> LossOutput:
    """Sum ``per_token * mask`` and attach the common metrics."""
    weighted = per_token * mask
    loss = weighted.sum()
    if clipped is None:
        clipped = torch.zeros_like(scored)
    metrics = {
        "pg_loss:sum": M.metric_sum(loss),
        "clip_fraction:mean": M.metric_mean(clipped.float(), scored),
        "num_loss_tokens:sum": M.metric_sum(scored.float()),
        **_ratio_metrics(ratio, lp, q, scored),
        **(extra_metrics or {}),
    }
    return LossOutput(loss=loss, elementwise_loss=weighted, scored=scored, metrics=metrics)


# ---- the losses ---------------------------------------------------------------------------


def importance_sampling(batch: LossInput, config: None) -> LossOutput:
    """``-ratio * A``: unclipped off-policy policy gradient."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    return _finish(-ratio * adv, mask, _scored(batch), ratio=ratio, lp=lp, q=q)


def regular(batch: LossInput, config: PPOConfig) -> LossOutput:
    """PPO clip: ``-min(r*A, clamp(r, lo, hi)*A)``."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    lo, hi = _bounds(batch, config.eps_clip_low, config.eps_clip_high, ratio)
    per_token, clipped = _ppo(ratio, adv, lo, hi)
    return _finish(per_token, mask, _scored(batch), ratio=ratio, lp=lp, q=q, clipped=clipped)


def dual_clip(batch: LossInput, config: DualClipConfig) -> LossOutput:
    """PPO clip, and for ``A < 0`` the loss is capped at ``-c*A`` (bounds very large ratios)."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    lo, hi = _bounds(batch, config.eps_clip_low, config.eps_clip_high, ratio)
    ppo_loss, ppo_clipped = _ppo(ratio, adv, lo, hi)
    cap = -adv * config.clip_ratio_c
    dual = (adv < 0) & (cap < ppo_loss)
    per_token = torch.where(adv < 0, torch.minimum(ppo_loss, cap), ppo_loss)
    scored = _scored(batch)
    return _finish(
        per_token, mask, scored, ratio=ratio, lp=lp, q=q, clipped=ppo_clipped | dual,
        extra_metrics={"dual_clip_fraction:mean": M.metric_mean(dual.float(), scored)},
    )


def _gspo_positions(batch: LossInput) -> torch.Tensor:
    """The positions M the sequence ratio averages over.

    ``sequence_ratio_mask != 0`` when sent; otherwise ``advantages != 0``, further restricted
    to ``weights != 0`` when weights are sent (the Tinker rule and SkyRL's loss-mask rule agree
    on every position a client would score).
    """
    srm = batch.inputs.get("sequence_ratio_mask")
    if srm is not None:
        return srm != 0
    positions = batch.inputs["advantages"] != 0
    w = batch.inputs.get("weights")
    return positions & (w != 0) if w is not None else positions


def gspo(batch: LossInput, config: PPOConfig) -> LossOutput:
    """GSPO-token: ``s_t = exp(log_s + lp_t - sg(lp_t))`` with ``log_s`` the per-datum mean of
    ``sg(lp) - q`` over M; then the PPO clip on ``s_t``. Reduced per segment, so exact under
    any packing. The exponent (numerically ``log_s``) is clamped to [-20, 20]."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    positions = _gspo_positions(batch)
    log_s = segment_mean(lp.detach() - q, batch.segment_ids, batch.num_segments, positions)
    seq_ratio = safe_ratio(lp, lp.detach() - log_s)
    lo, hi = _bounds(batch, config.eps_clip_low, config.eps_clip_high, seq_ratio)
    per_token, clipped = _ppo(seq_ratio, adv, lo, hi)
    scored = _scored(batch)
    out = _finish(per_token, mask, scored, ratio=seq_ratio, lp=lp, q=q, clipped=clipped)
    return attrs.evolve(out, extra_outputs={"sequence_ratio": seq_ratio.detach()})


def cispo(batch: LossInput, config: CispoConfig) -> LossOutput:
    """``-A * sg(clamp(r, lo, hi)) * lp``: the clipped IS weight scales a REINFORCE gradient,
    so no token's gradient is ever dropped."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    lo, hi = _bounds(batch, config.cispo_eps_clip_low, config.cispo_eps_clip_high, ratio)
    weight = torch.clamp(ratio, lo, hi).detach()
    clipped = (ratio < lo) | (ratio > hi)
    return _finish(-adv * weight * lp, mask, _scored(batch), ratio=ratio, lp=lp, q=q, clipped=clipped.detach())


def sapo(batch: LossInput, config: SapoConfig) -> LossOutput:
    """Soft gate instead of a clip: ``-sigmoid(tau*(r-1)) * (4/tau) * A``, tau by sign of A."""
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    tau = torch.where(adv > 0, torch.full_like(ratio, config.tau_pos), torch.full_like(ratio, config.tau_neg))
    per_token = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    return _finish(per_token, mask, _scored(batch), ratio=ratio, lp=lp, q=q)


def dro(batch: LossInput, config: DroConfig) -> LossOutput:
    """``-(lp*A - 0.5*beta*(lp - q)^2)``. Scores every position when no weights are sent,
    because the quadratic term contributes even where ``A = 0``."""
    lp, q, adv, mask, has_weights = _rl_inputs(batch)
    per_token = -(lp * adv - 0.5 * config.beta * (lp - q) ** 2)
    scored = (mask != 0) if has_weights else torch.ones_like(adv, dtype=torch.bool)
    return _finish(per_token, mask, scored, ratio=safe_ratio(lp, q), lp=lp, q=q)


# ---- covariance-selected losses (Entropy Mechanism of RL, arXiv 2505.22617) --------------


def _covariance(batch: LossInput) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``cov_t = (sg(lp_t) - mean(sg(lp))) * (A_t - mean(A))``, means over the scored tokens
    of this LossInput (the whole call, when called from ``prepare``)."""
    lp = batch.require_target_logprobs().detach()
    adv = batch.inputs["advantages"]
    scored = _scored(batch)
    s = scored.to(lp.dtype)
    n = s.sum().clamp_min(1.0)
    cov = (lp - (lp * s).sum() / n) * (adv - (adv * s).sum() / n)
    return cov, scored, int(scored.sum())


def clip_cov_prepare(batch: LossInput, config: ClipCovConfig) -> dict[str, torch.Tensor]:
    """Choose the tokens whose gradient clip_cov removes, over the whole call.

    Candidates: scored, not already clipped by PPO, and ``clip_cov_lb < cov < clip_cov_ub``.
    A random subset of ``max(1, int(clip_ratio * num_scored))`` of them (a CPU generator
    seeded with ``config.seed``, so reruns pick the same tokens) is marked 1.0.
    """
    cov, scored, num_scored = _covariance(batch)
    lp = batch.require_target_logprobs().detach()
    ratio = safe_ratio(lp, batch.inputs["logprobs"])
    lo, hi = 1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high
    _, ppo_clipped = _ppo(ratio, batch.inputs["advantages"], torch.full_like(ratio, lo), torch.full_like(ratio, hi))
    candidates = scored & ~ppo_clipped & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
    selected = torch.zeros_like(lp, dtype=torch.float32)
    idx = torch.nonzero(candidates).flatten()
    if num_scored == 0 or idx.numel() == 0:
        return {"clip_cov_selected": selected}
    k = max(1, int(config.clip_ratio * num_scored))
    gen = torch.Generator(device="cpu").manual_seed(int(config.seed))
    pick = torch.randperm(idx.numel(), generator=gen)[:k].to(idx.device)
    selected[idx[pick]] = 1.0
    return {"clip_cov_selected": selected}


def clip_cov(batch: LossInput, config: ClipCovConfig) -> LossOutput:
    """PPO clip loss; the tokens marked by ``clip_cov_selected`` keep their loss value but get
    no gradient. Without the prepared input the selection is computed on this micro-batch."""
    selected = batch.inputs.get("clip_cov_selected")
    if selected is None:
        selected = clip_cov_prepare(_detached(batch), config)["clip_cov_selected"]
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    lo, hi = _bounds(batch, config.eps_clip_low, config.eps_clip_high, ratio)
    ppo_loss, clipped = _ppo(ratio, adv, lo, hi)
    sel = selected != 0
    per_token = torch.where(sel, ppo_loss.detach(), ppo_loss)
    scored = _scored(batch)
    return _finish(
        per_token, mask, scored, ratio=ratio, lp=lp, q=q, clipped=clipped,
        extra_metrics={"clip_cov_fraction:mean": M.metric_mean(sel.float(), scored)},
    )


def kl_cov_prepare(batch: LossInput, config: KLCovConfig) -> dict[str, torch.Tensor]:
    """Mark the ``max(1, int(kl_cov_ratio * num_scored))`` scored tokens of largest cov."""
    cov, scored, num_scored = _covariance(batch)
    selected = torch.zeros_like(cov, dtype=torch.float32)
    if num_scored == 0:
        return {"kl_cov_selected": selected}
    k = min(num_scored, max(1, int(config.kl_cov_ratio * num_scored)))
    top = torch.topk(cov.masked_fill(~scored, -math.inf), k).indices
    selected[top] = 1.0
    return {"kl_cov_selected": selected}


def kl_cov(batch: LossInput, config: KLCovConfig) -> LossOutput:
    """``-r*A``, plus ``ppo_kl_coef * |lp - q|`` on the tokens marked by ``kl_cov_selected``.
    Without the prepared input the selection is computed on this micro-batch."""
    selected = batch.inputs.get("kl_cov_selected")
    if selected is None:
        selected = kl_cov_prepare(_detached(batch), config)["kl_cov_selected"]
    lp, q, adv, mask, _ = _rl_inputs(batch)
    ratio = safe_ratio(lp, q)
    sel = selected != 0
    per_token = -ratio * adv + sel.to(lp.dtype) * config.ppo_kl_coef * (lp - q).abs()
    scored = _scored(batch)
    return _finish(
        per_token, mask, scored, ratio=ratio, lp=lp, q=q,
        extra_metrics={"kl_cov_fraction:mean": M.metric_mean(sel.float(), scored)},
    )


def _detached(batch: LossInput) -> LossInput:
    return attrs.evolve(batch, target_logprobs=batch.require_target_logprobs().detach())


# ---- registration -------------------------------------------------------------------------

_CLIPPED = ("weights",) + THRESHOLD_INPUTS


@hookimpl
def skyrl_sdk_register_losses(register: Register) -> None:
    common = dict(required_inputs=RL_REQUIRED, outputs=OUTPUTS, role="policy")
    register(
        "importance_sampling", importance_sampling,
        description="Unclipped importance-sampled policy gradient, -sum(ratio * A).",
        optional_inputs=("weights",), **common,
    )
    register(
        "regular", regular,
        description="PPO clipped surrogate, -sum(min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A)) (Tinker 'ppo').",
        optional_inputs=_CLIPPED, config_cls=PPOConfig, **common,
    )
    register(
        "dual_clip", dual_clip,
        description="PPO clip with a dual clip: for A < 0 the loss is capped at -clip_ratio_c * A.",
        optional_inputs=_CLIPPED, config_cls=DualClipConfig, **common,
    )
    register(
        "gspo", gspo,
        description="GSPO-token: PPO clip on the per-datum geometric-mean ratio, each token's own gradient.",
        optional_inputs=_CLIPPED + ("sequence_ratio_mask",), config_cls=PPOConfig, **common,
    )
    register(
        "cispo", cispo,
        description="CISPO: -sum(A * sg(clamp(r, 1-cl, 1+ch)) * lp); clipped IS weight, no dropped gradients.",
        optional_inputs=_CLIPPED, config_cls=CispoConfig, **common,
    )
    register(
        "sapo", sapo,
        description="SAPO: soft sigmoid gate -sigmoid(tau*(r-1)) * (4/tau) * A, tau by the sign of A.",
        optional_inputs=("weights",), config_cls=SapoConfig, **common,
    )
    register(
        "dro", dro,
        description="DRO: -sum(lp*A - 0.5*beta*(lp - q)^2).",
        optional_inputs=("weights",), config_cls=DroConfig, **common,
    )
    register(
        "clip_cov", clip_cov,
        description="Clip-Cov: PPO clip, with random high-covariance tokens (whole call) detached.",
        optional_inputs=("weights", "clip_cov_selected"), config_cls=ClipCovConfig,
        prepare=clip_cov_prepare, **common,
    )
    register(
        "kl_cov", kl_cov,
        description="KL-Cov: -ratio*A plus ppo_kl_coef*|lp - q| on the top-covariance tokens of the whole call.",
        optional_inputs=("weights", "kl_cov_selected"), config_cls=KLCovConfig,
        prepare=kl_cov_prepare, **common,
    )
