"""The ``native`` dialect: SkyRL's canonical loss names and config keys, taken as they are."""

from __future__ import annotations

from ..hookspecs import hookimpl

#: SkyRL's name for the critic's clipped value loss (``ppo_critic_loss``) -> canonical ``value``.
_CRITIC_ALIASES = {"ppo_critic_loss": "value"}


def convert_native(loss_fn, loss_fn_config, role):
    """Canonical names pass straight through to the loss registry (plus SkyRL's critic alias)."""
    if role == "critic" and loss_fn in _CRITIC_ALIASES:
        return _CRITIC_ALIASES[loss_fn], dict(loss_fn_config or {})
    return None


@hookimpl
def skyrl_sdk_register_dialects(register):
    register("native", convert_native, description="Canonical (SkyRL) loss names and config keys, unchanged.")
