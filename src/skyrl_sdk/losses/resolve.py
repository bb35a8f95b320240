"""Turning ``(loss_fn, loss_fn_config, dialect)`` into a registered loss and a typed config."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ..errors import LossConfigError, UnknownLossError, closest, did_you_mean
from .base import DialectSpec, LossSpec
from .contract import dialect_config_keys
from .terms import TERM_KEY_MEANING, TERM_KEY_OF_INPUT, LossTerms, build_terms, required_inputs, split_terms, term_keys


def loss_label(requested: str, native: str) -> str:
    """How errors name a loss: as the caller typed it, with the native name when they differ."""
    if requested == native:
        return f"loss {native!r}"
    return f"loss {requested!r} (native {native!r})"


@attrs.frozen
class ResolvedLoss:
    """A loss ready to run: its spec, a validated config instance (``None`` if it takes none)
    and the shared :class:`~skyrl_sdk.losses.terms.LossTerms` (reduction, KL, entropy)."""

    spec: LossSpec
    config: Any
    requested_name: str
    dialect: str
    terms: LossTerms = attrs.field(factory=LossTerms)
    #: The plugin that registered the loss (named when its output is malformed).
    plugin: str | None = None
    #: input -> why the call needs it, when a config key probably meant another (named in the
    #: error that says the input is missing: :func:`term_near_misses`)
    hints: Mapping[str, str] = attrs.field(factory=dict)
    #: Only the model's per-token scores are wanted (a critic's forward that reads its values,
    #: :func:`reading_values`): the loss function is not run and reports no loss.
    scores_only: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def label(self) -> str:
        """``"loss 'ppo' (native 'regular')"``: the name the caller used, for error messages."""
        return loss_label(self.requested_name, self.spec.name)


def build_config(spec: LossSpec, config: Mapping[str, Any] | None, label: str | None = None) -> Any:
    """Validate a config dict (without the loss-term keys) against the loss's config class;
    errors name the key and the loss as the caller typed it (``label``)."""
    label = label or loss_label(spec.name, spec.name)
    config = dict(config or {})
    if spec.config_cls is None:
        if config:
            raise LossConfigError(
                f"{label} takes no loss_fn_config of its own, got keys {sorted(config)}; "
                f"keys every {spec.role} loss takes: {list(term_keys(spec.role))}"
            )
        return None
    accepted = spec.config_keys()
    for key in config:
        if key not in accepted:
            everything = list(accepted) + list(term_keys(spec.role))
            raise LossConfigError(
                f"{label}: unknown loss_fn_config key {key!r}; accepted keys: {everything}"
                f"{did_you_mean(key, everything)}"
            )
    try:
        return spec.config_cls(**config)
    except (TypeError, ValueError) as exc:
        raise LossConfigError(f"{label}: invalid loss_fn_config: {exc}") from None


def term_near_misses(shared: Mapping[str, Any], terms: LossTerms, own_keys: Iterable[str]) -> dict[str, str]:
    """Input -> hint, for each input a loss term turned on by a key that is close to one of the
    loss's own keys: ``kl_coef`` (every loss's KL term to a reference model, which needs
    ``ref_logprobs``) sent to stable_reinforce, whose own key is ``kl_coeff``."""
    hints = {}
    for key in required_inputs(terms):
        term_key = TERM_KEY_OF_INPUT[key]
        close = closest(term_key, [k for k in own_keys if k != term_key]) if term_key in shared else None
        if close:
            hints[key] = (f"did you mean this loss's own {close!r}? {term_key!r} is {TERM_KEY_MEANING[term_key]} "
                          f"that every loss takes, which reads {key!r}")
    return hints


def resolve_loss(
    losses: Mapping[str, LossSpec],
    dialect: DialectSpec,
    loss_fn: str,
    loss_fn_config: Mapping[str, Any] | None = None,
    role: str = "policy",
) -> ResolvedLoss:
    """Map a client's loss name and config through ``dialect`` to one of ``losses`` (native
    name -> spec: the registry's, or any other set of specs)."""
    if not isinstance(loss_fn, str) or not loss_fn:
        raise UnknownLossError(f"loss_fn must be a non-empty string, got {loss_fn!r}")
    if loss_fn_config is not None and not isinstance(loss_fn_config, Mapping):
        raise LossConfigError(f"loss_fn_config must be a mapping or None, got {type(loss_fn_config).__name__}")
    own_config, shared = split_terms(loss_fn_config)
    converted = dialect.convert(loss_fn, own_config, role)
    if converted is None:
        name, config = loss_fn, own_config
    else:
        name, config = converted
    spec = losses.get(name)
    if spec is None:
        available = sorted(set(losses) | set(getattr(dialect.convert, "names", ())))
        raise UnknownLossError(
            f"unknown loss_fn {loss_fn!r} (dialect {dialect.name!r}); available: {available}"
            f"{did_you_mean(loss_fn, available)}"
        )
    if spec.role != role:
        raise UnknownLossError(
            f"loss_fn {loss_fn!r} resolves to {spec.name!r}, a {spec.role} loss, but this model's role is {role!r}"
        )
    terms = build_terms(shared, role, loss_fn)
    extra = tuple(k for k in required_inputs(terms) if k not in spec.required_inputs)
    if extra:  # validation then asks every datum for them (e.g. ref_logprobs with a KL term)
        optional = tuple(k for k in spec.optional_inputs if k not in extra)
        spec = attrs.evolve(spec, required_inputs=spec.required_inputs + extra, optional_inputs=optional)
    return ResolvedLoss(
        spec=spec, config=build_config(spec, config, loss_label(loss_fn, spec.name)), requested_name=loss_fn,
        dialect=dialect.name, terms=terms, plugin=spec.plugin,
        hints=term_near_misses(shared, terms, dialect_config_keys(dialect, loss_fn, spec)),
    )


def reading_values(resolved: ResolvedLoss, inputs_keys: set[str]) -> ResolvedLoss:
    """A critic's forward whose datums carry none of its loss's required inputs (no ``values``,
    no ``returns``) reads the values: ``resolved`` made :attr:`~ResolvedLoss.scores_only`, with
    nothing required. Any other call (a policy's, a critic's with some of the inputs) is
    returned as it is, and validation names what is missing."""
    if resolved.spec.role != "critic" or inputs_keys & set(resolved.spec.required_inputs):
        return resolved
    optional = tuple(dict.fromkeys(resolved.spec.optional_inputs + resolved.spec.required_inputs))
    spec = attrs.evolve(resolved.spec, required_inputs=(), optional_inputs=optional)
    return attrs.evolve(resolved, spec=spec, scores_only=True)
