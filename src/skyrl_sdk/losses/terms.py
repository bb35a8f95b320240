"""``loss_fn_config`` keys every loss shares: the reduction, and (policy) KL and entropy terms.

They are split off the client's config before its dialect converts the rest (so both
dialects, and every plugin loss, accept them), live in :class:`LossTerms` on the
:class:`~skyrl_sdk.losses.resolve.ResolvedLoss`, and are applied by ``run_loss`` on top of
what the loss function returns::

    total = reduce(l) + kl_coef * reduce(m * kl(lp, ref)) - entropy_coef * reduce(m * H)

``reduce`` is the :mod:`~skyrl_sdk.losses.reduction` chosen by ``loss_reduction``; ``l`` is the
loss's ``elementwise_loss`` (only ``seq_mean_token_mean`` needs it per token; the others scale
the summed ``loss``). The call-level normalizers are filled in by :func:`with_call_normalizers`
before the call is split into micro-batches or ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from ..checks import check_number
from ..errors import DatumError, LossConfigError
from ..metrics import Metric
from .base import LossInput, LossOutput
from .reduction import REDUCTIONS, USES_SEQUENCES, USES_TOKENS, reduce_tokens, token_mask, token_scale
from .regularizers import KL_ESTIMATORS, kl_estimate

REDUCTION_KEYS = ("loss_reduction", "max_seq_len", "num_tokens_normalizer", "num_sequences_normalizer")
POLICY_TERM_KEYS = ("kl_coef", "kl_estimator", "entropy_coef")
#: Metrics a loss reports as its own summed loss; with a reduction they report the reduced value.
PRIMARY_LOSS_METRICS = ("pg_loss:sum", "vf_loss:sum")


def _number(key: str, value: Any, *, positive: bool = False, nonnegative: bool = False) -> None:
    check_number(key, value, low=0.0 if positive or nonnegative else None, low_open=positive)


@attrs.frozen
class LossTerms:
    """The shared keys, validated. Defaults reproduce Tinker: a plain sum, no extra terms."""

    loss_reduction: str = "sum"
    max_seq_len: int | None = None
    num_tokens_normalizer: float | None = None
    num_sequences_normalizer: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction: expected one of {list(REDUCTIONS)}, got {self.loss_reduction!r}")
        norm = self.loss_reduction == "seq_mean_token_sum_norm"
        if self.max_seq_len is not None:
            check_number("max_seq_len", self.max_seq_len, low=0, low_open=True, integer=True)
            if not norm:
                raise ValueError("max_seq_len is only used by loss_reduction 'seq_mean_token_sum_norm', "
                                 f"got loss_reduction {self.loss_reduction!r}")
        elif norm:
            raise ValueError("loss_reduction 'seq_mean_token_sum_norm' needs max_seq_len (an integer > 0)")
        for key, users in (("num_tokens_normalizer", USES_TOKENS), ("num_sequences_normalizer", USES_SEQUENCES)):
            value = getattr(self, key)
            if value is None:
                continue
            _number(key, value, positive=True)
            if self.loss_reduction not in users:
                raise ValueError(f"{key} is only used by loss_reduction {' / '.join(users)}, "
                                 f"got loss_reduction {self.loss_reduction!r}")
        _number("kl_coef", self.kl_coef, nonnegative=True)
        _number("entropy_coef", self.entropy_coef)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: expected one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}")

    @property
    def plain(self) -> bool:
        """Nothing to add to the loss function's own summed loss."""
        return self.loss_reduction == "sum" and self.kl_coef == 0 and self.entropy_coef == 0


def split_terms(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the loss's own config keys, the shared keys)`` of a client's ``loss_fn_config``."""
    config = dict(config or {})
    shared = {k: config.pop(k) for k in REDUCTION_KEYS + POLICY_TERM_KEYS if k in config}
    return config, shared


def build_terms(shared: Mapping[str, Any], role: str, loss_name: str) -> LossTerms:
    """Validate the shared keys; errors name the loss and the key."""
    if role != "policy":
        for key in POLICY_TERM_KEYS:
            if key in shared:
                raise LossConfigError(f"loss {loss_name!r}: loss_fn_config key {key!r} is a policy term; this "
                                      f"model's role is {role!r}")
    try:
        return LossTerms(**shared)
    except (TypeError, ValueError) as exc:
        raise LossConfigError(f"loss {loss_name!r}: invalid loss_fn_config: {exc}") from None


def required_inputs(terms: LossTerms) -> tuple[str, ...]:
    """Inputs the terms need on top of the loss's own: ``ref_logprobs`` with a KL term."""
    return ("ref_logprobs",) if terms.kl_coef > 0 else ()


def with_call_normalizers(resolved, datums: Sequence):
    """The ResolvedLoss with the call-level normalizers its reduction needs filled in.

    Called once per call on all datums (before micro-batching and the rank split); a
    client-given ``num_tokens_normalizer`` / ``num_sequences_normalizer`` is kept as given.
    Also refuses a KL term on top-K targets (one logprob per position is needed).
    """
    from .reduction import call_normalizers

    terms = resolved.terms
    if terms.kl_coef > 0:
        for i, d in enumerate(datums):
            shape = d.loss_fn_inputs["target_tokens"].shape if "target_tokens" in d.loss_fn_inputs else ()
            if len(shape) == 2:
                raise DatumError("kl_coef > 0 needs one target per position (shape (N,)), got top-K targets "
                                 f"of shape {list(shape)}", index=i, key="target_tokens")
    if terms.loss_reduction == "sum":
        return resolved
    num_tokens, num_sequences = call_normalizers(datums)
    changes = {}
    if terms.loss_reduction in USES_TOKENS and terms.num_tokens_normalizer is None:
        changes["num_tokens_normalizer"] = num_tokens
    if terms.loss_reduction in USES_SEQUENCES and terms.num_sequences_normalizer is None:
        changes["num_sequences_normalizer"] = num_sequences
    return attrs.evolve(resolved, terms=attrs.evolve(terms, **changes)) if changes else resolved


def _reduced_loss(name: str, out: LossOutput, scale) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        return out.loss * scale if scale != 1.0 else out.loss
    per_token = out.elementwise_loss
    if per_token is None:
        raise LossConfigError(f"loss {name!r} returns no elementwise_loss, so it cannot use a per-sequence "
                              f"loss_reduction (seq_mean_token_mean); use 'sum' or a uniform reduction")
    if per_token.dim() != 1:
        raise LossConfigError(f"loss {name!r}: elementwise_loss must have shape (T,), got {tuple(per_token.shape)}")
    if out.loss.requires_grad and not per_token.requires_grad:
        raise LossConfigError(f"loss {name!r} returns a detached elementwise_loss; seq_mean_token_mean needs it "
                              f"differentiable (with elementwise_loss.sum() == loss)")
    return reduce_tokens(per_token, scale)


def apply_terms(name: str, terms: LossTerms, batch: LossInput, out: LossOutput) -> LossOutput:
    """The loss function's output with the reduction, KL and entropy terms applied."""
    if terms.plain:
        return out
    scale = token_scale(
        terms.loss_reduction, batch, num_tokens=terms.num_tokens_normalizer,
        num_sequences=terms.num_sequences_normalizer, max_seq_len=terms.max_seq_len,
    )
    base = _reduced_loss(name, out, scale)
    metrics = dict(out.metrics)
    if terms.loss_reduction != "sum":
        for key in PRIMARY_LOSS_METRICS:
            if key in metrics:
                metrics[key] = Metric(float(base.detach()))
    total = base
    mask = token_mask(batch) if terms.kl_coef > 0 or terms.entropy_coef != 0 else None
    if terms.kl_coef > 0:
        kl = kl_estimate(batch.target_logprobs, batch.inputs["ref_logprobs"], terms.kl_estimator) * mask
        kl_loss = reduce_tokens(kl, scale)
        metrics["kl_loss:sum"] = Metric(float(kl_loss.detach()))
        total = total + terms.kl_coef * kl_loss
    if terms.entropy_coef != 0:
        if batch.entropy is None:
            raise LossConfigError(f"loss {name!r}: entropy_coef needs the model's entropy, which this engine "
                                  "did not compute")
        entropy = reduce_tokens(batch.entropy * mask, scale)
        total = total - terms.entropy_coef * entropy
    return attrs.evolve(out, loss=total, metrics=metrics)
