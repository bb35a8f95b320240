"""The ``native`` dialect: SkyRL's canonical loss names and config keys, taken as they are."""

from __future__ import annotations

from ..hookspecs import hookimpl


def convert_native(loss_fn, loss_fn_config, role):
    """Canonical names pass straight through to the loss registry."""
    return None


@hookimpl
def skyrl_sdk_register_dialects(register):
    register("native", convert_native, description="Canonical (SkyRL) loss names and config keys, unchanged.")
