"""Turning ``(loss_fn, loss_fn_config, dialect)`` into a registered loss and a typed config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import attrs

from ..errors import LossConfigError, UnknownLossError, UnknownNameError
from .base import LossSpec

if TYPE_CHECKING:
    from ..registry import Registry


@attrs.frozen
class ResolvedLoss:
    """A loss ready to run: its spec and a validated config instance (``None`` if it takes none)."""

    spec: LossSpec
    config: Any
    requested_name: str
    dialect: str
    #: The plugin that registered the loss (named when its output is malformed).
    plugin: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def build_config(spec: LossSpec, config: Mapping[str, Any] | None) -> Any:
    """Validate a config dict against the loss's config class; errors name the key."""
    config = dict(config or {})
    if spec.config_cls is None:
        if config:
            raise LossConfigError(
                f"loss {spec.name!r} takes no loss_fn_config, got keys {sorted(config)}"
            )
        return None
    accepted = spec.config_keys()
    for key in config:
        if key not in accepted:
            raise LossConfigError(
                f"loss {spec.name!r}: unknown loss_fn_config key {key!r}; accepted keys: {list(accepted)}"
            )
    try:
        return spec.config_cls(**config)
    except (TypeError, ValueError) as exc:
        raise LossConfigError(f"loss {spec.name!r}: invalid loss_fn_config: {exc}") from None


def resolve_loss(
    registry: Registry,
    loss_fn: str,
    loss_fn_config: Mapping[str, Any] | None = None,
    dialect: str = "tinker",
    role: str = "policy",
) -> ResolvedLoss:
    """Map a client's loss name and config through ``dialect`` to a canonical loss."""
    if not isinstance(loss_fn, str) or not loss_fn:
        raise UnknownLossError(f"loss_fn must be a non-empty string, got {loss_fn!r}")
    if loss_fn_config is not None and not isinstance(loss_fn_config, Mapping):
        raise LossConfigError(f"loss_fn_config must be a mapping or None, got {type(loss_fn_config).__name__}")
    dialect_spec = registry.dialects.get(dialect)
    if dialect_spec is None:
        raise UnknownNameError(f"unknown dialect {dialect!r}; available: {sorted(registry.dialects)}")
    converted = dialect_spec.convert(loss_fn, loss_fn_config, role)
    if converted is None:
        name, config = loss_fn, dict(loss_fn_config or {})
    else:
        name, config = converted
    spec = registry.losses.get(name)
    if spec is None:
        available = sorted(set(registry.losses) | set(getattr(dialect_spec.convert, "names", ())))
        raise UnknownLossError(f"unknown loss_fn {loss_fn!r} (dialect {dialect!r}); available: {available}")
    if spec.role != role:
        raise UnknownLossError(
            f"loss_fn {loss_fn!r} resolves to {spec.name!r}, a {spec.role} loss, but this model's role is {role!r}"
        )
    return ResolvedLoss(spec=spec, config=build_config(spec, config), requested_name=loss_fn, dialect=dialect,
                        plugin=registry.owners.get(("loss", spec.name)))
