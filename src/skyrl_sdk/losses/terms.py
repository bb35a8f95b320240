"""Loss terms: the ``loss_fn_config`` keys every loss shares (the reduction, and for a policy
the KL and entropy terms), and applying them on top of a loss function's output.

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

from ..errors import LossConfigError
from ..types.numbers import check_number
from .base import LossInput, LossOutput
from .metrics import Metric
from .reduction import (
    PER_TOKEN_REDUCTIONS,
    REDUCTIONS,
    USES_SEQUENCES,
    USES_TOKENS,
    reduce_tokens,
    token_mask,
    token_scale,
)

REDUCTION_KEYS = ("loss_reduction", "max_seq_len", "num_tokens_normalizer", "num_sequences_normalizer")
POLICY_TERM_KEYS = ("kl_coef", "kl_estimator", "entropy_coef")
#: Metrics a loss reports as its own summed loss; with a reduction they report the reduced value.
PRIMARY_LOSS_METRICS = ("pg_loss:sum", "vf_loss:sum")


def term_keys(role: str) -> tuple[str, ...]:
    """The loss_fn_config keys every loss of ``role`` takes besides its own: the reduction's,
    and for a policy the KL and entropy terms'."""
    return REDUCTION_KEYS + (POLICY_TERM_KEYS if role == "policy" else ())


KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "low_var_kl")
#: ``k3`` / ``low_var_kl``: clamp of ``ref - lp`` before exp, and of the estimate itself.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(learner || reference) from sampled-token logprobs."""
    if estimator == "k1":
        return lp - ref
    if estimator == "abs":
        return (lp - ref).abs()
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    if estimator in ("k3", "low_var_kl"):
        log_ratio = (ref - lp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {list(KL_ESTIMATORS)}")


def _number(key: str, value: Any, *, positive: bool = False, nonnegative: bool = False) -> None:
    check_number(key, value, low=0.0 if positive or nonnegative else None, low_open=positive)


@attrs.frozen
class LossTerms:
    """The loss terms, validated. Defaults reproduce Tinker: a plain sum, no extra terms."""

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
    """``(the loss's own config keys, the loss-term keys)`` of a client's ``loss_fn_config``."""
    config = dict(config or {})
    shared = {k: config.pop(k) for k in REDUCTION_KEYS + POLICY_TERM_KEYS if k in config}
    return config, shared


def build_terms(shared: Mapping[str, Any], role: str, loss_name: str) -> LossTerms:
    """Validate the loss-term keys; errors name the loss and the key."""
    if role != "policy":
        for key in POLICY_TERM_KEYS:
            if key in shared:
                raise LossConfigError(f"loss {loss_name!r}: loss_fn_config key {key!r} is a policy term; this "
                                      f"model's role is {role!r}")
    try:
        return LossTerms(**shared)
    except (TypeError, ValueError) as exc:
        raise LossConfigError(f"loss {loss_name!r}: invalid loss_fn_config: {exc}") from None


#: Inputs only a loss term reads, and what turns that term on (named when one comes without it).
TERM_INPUTS = {"ref_logprobs": "kl_coef > 0 (the KL term to a reference model)"}
#: ... the loss_fn_config key of that term, and what that key is
TERM_KEY_OF_INPUT = {"ref_logprobs": "kl_coef"}
TERM_KEY_MEANING = {"kl_coef": "the weight of the KL term to a reference model"}
#: How a caller gets each term input (said when one is missing).
TERM_INPUT_SOURCES = {
    "ref_logprobs": "the logprobs a frozen reference model gives the same target_tokens: "
                    "ref = reference.forward(data, 'cross_entropy'), then "
                    "data = skyrl_sdk.rl.with_ref_logprobs(data, ref) (over HTTP: a reference client's "
                    "forward, its 'logprobs' as each datum's loss_fn_inputs['ref_logprobs']); "
                    "or kl_coef 0 for no KL term",
}


def required_inputs(terms: LossTerms) -> tuple[str, ...]:
    """Inputs the terms need on top of the loss's own: ``ref_logprobs`` with a KL term."""
    return ("ref_logprobs",) if terms.kl_coef > 0 else ()


def with_call_normalizers(resolved: Any, datums: Sequence) -> Any:  # a ResolvedLoss (.resolve imports this module)
    """The ResolvedLoss with the call-level normalizers its reduction needs filled in.

    Called once per call on all datums (before micro-batching and the rank split); a
    client-given ``num_tokens_normalizer`` / ``num_sequences_normalizer`` is kept as given.
    """
    from .reduction import call_normalizers

    terms = resolved.terms
    if terms.loss_reduction == "sum":
        return resolved
    num_tokens, num_sequences = call_normalizers(datums)
    changes = {}
    if terms.loss_reduction in USES_TOKENS and terms.num_tokens_normalizer is None:
        changes["num_tokens_normalizer"] = num_tokens
    if terms.loss_reduction in USES_SEQUENCES and terms.num_sequences_normalizer is None:
        changes["num_sequences_normalizer"] = num_sequences
    return attrs.evolve(resolved, terms=attrs.evolve(terms, **changes)) if changes else resolved


def elementwise_loss_problem(terms: LossTerms, batch: LossInput, out: LossOutput) -> str | None:
    """What is wrong with a loss's ``elementwise_loss`` for ``terms``' reduction, or None.

    A loss that may use a per-token reduction declared ``elementwise_loss`` (checked before
    compute), so a missing or malformed one here is the loss's fault (``run_loss`` says so)."""
    if terms.loss_reduction not in PER_TOKEN_REDUCTIONS:
        return None
    per_token = out.elementwise_loss
    if not isinstance(per_token, torch.Tensor):
        return f"returned no elementwise_loss though it declares one (loss_reduction {terms.loss_reduction!r})"
    if tuple(per_token.shape) != (batch.num_tokens,):
        return f"returned an elementwise_loss of shape {tuple(per_token.shape)}, expected ({batch.num_tokens},)"
    if out.loss.requires_grad and not per_token.requires_grad:
        return (f"returned a detached elementwise_loss; loss_reduction {terms.loss_reduction!r} needs it "
                f"differentiable (with elementwise_loss.sum() == loss)")
    return None


def _reduced_loss(out: LossOutput, scale: float | torch.Tensor) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        return out.loss * scale if scale != 1.0 else out.loss
    assert out.elementwise_loss is not None  # elementwise_loss_problem refused a missing one
    return reduce_tokens(out.elementwise_loss, scale)


def apply_terms(name: str, terms: LossTerms, batch: LossInput, out: LossOutput) -> LossOutput:
    """The loss function's output with the reduction, KL and entropy terms applied."""
    if terms.plain:
        return out
    scale = token_scale(
        terms.loss_reduction, batch, num_tokens=terms.num_tokens_normalizer,
        num_sequences=terms.num_sequences_normalizer, max_seq_len=terms.max_seq_len,
    )
    base = _reduced_loss(out, scale)
    metrics = dict(out.metrics)
    if terms.loss_reduction != "sum":
        for key in PRIMARY_LOSS_METRICS:
            if key in metrics:
                metrics[key] = Metric(base.detach())
    total = base
    mask = token_mask(batch)
    if terms.kl_coef > 0:
        kl = kl_estimate(batch.require_target_logprobs(), batch.inputs["ref_logprobs"], terms.kl_estimator) * mask
        kl_loss = reduce_tokens(kl, scale)
        metrics["kl_loss:sum"] = Metric(kl_loss.detach())
        total = total + terms.kl_coef * kl_loss
    if terms.entropy_coef != 0:
        if batch.entropy is None:
            raise LossConfigError(f"loss {name!r}: entropy_coef needs the model's entropy, which this engine "
                                  "did not compute")
        entropy = reduce_tokens(batch.entropy * mask, scale)
        total = total - terms.entropy_coef * entropy
    return attrs.evolve(out, loss=total, metrics=metrics)
