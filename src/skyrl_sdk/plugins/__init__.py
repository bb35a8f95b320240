"""The plugin machinery: the registry of losses, dialects, engines and samplers
(:mod:`.registry`), and loading the built-ins and entry-point plugins into it
(:mod:`.manager`). The hooks themselves are in :mod:`skyrl_sdk.hooks`.
"""

from __future__ import annotations

from .manager import ENTRY_POINT_GROUP, ENV_VAR, get_plugins, get_registry, load_plugins, reset

__all__ = ["ENTRY_POINT_GROUP", "ENV_VAR", "get_plugins", "get_registry", "load_plugins", "reset"]
