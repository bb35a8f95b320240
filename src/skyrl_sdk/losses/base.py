"""The loss contract: what a loss function receives, returns, and registers with.

Losses work on **packed 1-D token tensors** plus a per-token ``segment_ids`` tensor that says
which datum each token belongs to. The engine may put any subset of the datums of a call
into one :class:`LossInput` (a micro-batch) but never splits a datum, so a loss that sums
over tokens (and reduces sequence-level quantities per segment) gives the same total
whatever the micro-batching, packing or number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import numpy as np
import torch

from ..errors import DatumError
from ..types import Datum
from .metrics import Metric

Role = Literal["policy", "critic"]


@attrs.frozen(eq=False)
class LossInput:
    """What a loss function receives for one micro-batch.

    - ``target_logprobs``: (T,) or (T, K) log-probabilities of ``target_tokens`` under the
      current model, differentiable (policy role; ``None`` for critics).
    - ``values``: (T,) predicted values, differentiable (critic role; ``None`` otherwise).
    - ``inputs``: every ``loss_fn_inputs`` tensor the caller sent, packed like the tokens
      (float32 except ``target_tokens``), already on the model's device.
    - ``segment_ids``: (T,) int64 in ``[0, num_segments)``: the datum each token belongs to.
    - ``entropy``: (T,) entropy of the model's next-token distribution, or ``None``; it carries
      its exact gradient when the engine computes with gradients (the ``entropy_coef`` bonus).
    """

    inputs: Mapping[str, torch.Tensor]
    segment_ids: torch.Tensor
    num_segments: int
    target_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    @classmethod
    def for_role(cls, role: str, scores: torch.Tensor, **kwargs: Any) -> LossInput:
        """A LossInput whose differentiable scores are a critic's ``values`` or a policy's
        ``target_logprobs``: the one place that maps a role to the field."""
        return cls(values=scores, **kwargs) if role == "critic" else cls(target_logprobs=scores, **kwargs)

    @property
    def num_tokens(self) -> int:
        return int(self.segment_ids.shape[0])

    def get(self, key: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.inputs.get(key, default)

    def require_target_logprobs(self) -> torch.Tensor:
        """``target_logprobs``, which a policy loss needs (``None`` only in a critic's input)."""
        if self.target_logprobs is None:
            raise ValueError("LossInput.target_logprobs is None: a policy loss got a critic's input")
        return self.target_logprobs

    def require_values(self) -> torch.Tensor:
        """``values``, which a critic loss needs (``None`` only in a policy's input)."""
        if self.values is None:
            raise ValueError("LossInput.values is None: a critic loss got a policy's input")
        return self.values

    def scores(self) -> torch.Tensor:
        """The differentiable per-token scores: a critic's ``values`` or a policy's ``target_logprobs``."""
        return self.require_values() if self.values is not None else self.require_target_logprobs()

    def mask(self) -> torch.Tensor:
        """The ``weights`` input as a float mask (ones when absent)."""
        w = self.inputs.get("weights")
        if w is not None:
            return w
        return torch.ones(self.num_tokens, dtype=torch.float32, device=self.scores().device)


@attrs.frozen(eq=False)
class LossOutput:
    """What a loss function returns.

    - ``loss``: scalar, the SUM of the per-token loss over this micro-batch (differentiable).
    - ``elementwise_loss``: (T,) per-token loss with ``elementwise_loss.sum() == loss``, returned
      (detached) per datum when listed in ``outputs``. Return it differentiable: the
      ``seq_mean_token_mean`` reduction weights it per sequence (see ``losses.terms``).
    - ``scored``: (T,) bool, the positions the loss scores; ``entropy_loss:sum`` sums the
      entropy there. ``None`` means every position.
    - ``metrics``: ``{"name:reduction": Metric}`` contributions (see :mod:`skyrl_sdk.losses.metrics`).
    - ``extra_outputs``: more per-token tensors to return per datum, e.g. ``{"ratio": r}``.
    """

    loss: torch.Tensor
    elementwise_loss: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    metrics: Mapping[str, Metric] = attrs.field(factory=dict)
    extra_outputs: Mapping[str, torch.Tensor] = attrs.field(factory=dict)


def scores_key(role: str) -> str:
    """The output name of the per-token scores a model of ``role`` returns: a critic's
    ``values`` or a policy's ``logprobs``. The one place that maps a role to that name."""
    return "values" if role == "critic" else "logprobs"


LossFn = Callable[[LossInput, Any], LossOutput]
PrepareFn = Callable[[LossInput, Any], Mapping[str, torch.Tensor]]


@attrs.frozen
class LossSpec:
    """A registered loss.

    ``prepare`` (optional) sees the *whole call* with detached logprobs before any gradient
    pass and returns extra per-token inputs (e.g. clip_cov's token selection). It is how
    batch-level statistics stay exact under micro-batching.
    """

    name: str
    fn: LossFn
    description: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_cls: type | None = None
    outputs: tuple[str, ...] = ("logprobs",)
    role: Role = "policy"
    prepare: PrepareFn | None = None
    #: Whether target_tokens may have shape (N, K) (top-K distillation).
    accepts_topk_targets: bool = False
    #: Whether every datum must carry provenance naming recorded sampled sequences: the caller
    #: resolves it (:func:`skyrl_sdk.losses.stability.resolve_provenance`) into the recorded
    #: sampler ``logprobs`` and ``sampled_mask`` before the call is checked.
    needs_provenance: bool = False
    #: The plugin that registered it (set by the registry; named when its output is malformed).
    plugin: str | None = None

    def config_defaults(self) -> dict[str, Any]:
        if self.config_cls is None:
            return {}
        return {f.name: f.default for f in attrs.fields(self.config_cls)}

    def config_keys(self) -> tuple[str, ...]:
        return tuple(self.config_defaults())


@attrs.frozen
class DialectSpec:
    """A registered dialect: ``convert(loss_fn, loss_fn_config, role)`` maps a client's loss
    name and config to a native ``(name, config)``, or returns None for names it does not claim."""

    name: str
    convert: Callable[[str, Mapping[str, Any] | None, str], tuple[str, dict] | None]
    description: str = ""


# ---- helpers that loss authors use -------------------------------------------------------


def segment_sum(x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum ``x`` (T,) per segment -> (num_segments,). Differentiable."""
    out = torch.zeros(num_segments, dtype=x.dtype, device=x.device)
    return out.index_add(0, segment_ids, x)


def segment_mean(
    x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int, mask: torch.Tensor
) -> torch.Tensor:
    """Masked mean of ``x`` per segment, broadcast back to tokens (T,). Empty segments give 0."""
    mask = mask.to(x.dtype)
    sums = segment_sum(x * mask, segment_ids, num_segments)
    counts = segment_sum(mask, segment_ids, num_segments)
    means = sums / counts.clamp_min(1.0)
    return means[segment_ids]


LOG_RATIO_CLAMP = 20.0


def safe_ratio(target_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(lp - q)`` with ``lp - q`` clamped to [-20, 20] for numerical safety."""
    return torch.exp((target_logprobs - sampler_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def check_finite_inputs(datum: Datum, index: int) -> None:
    """Every loss input of ``datum`` but its token ids holds finite values, else a DatumError
    naming the first offender. Every loss is held to it, before anything reads the values (a
    loss whose inputs are replaced from records, as ``stable_reinforce``'s logprobs, too)."""
    for key, tensor in datum.loss_fn_inputs.items():
        array = tensor.array
        if key != "target_tokens" and array.size and not np.isfinite(array).all():
            bad = int(np.flatnonzero(~np.isfinite(array.reshape(-1)))[0])
            raise DatumError(f"expected finite values, got {array.reshape(-1)[bad]} at flat position {bad}",
                             index=index, key=key)
