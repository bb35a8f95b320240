"""The plugin machinery: the registry of losses, dialects, engines and samplers
(:mod:`.registry`), loading the built-ins it is handed and the entry-point plugins into it
through pluggy (:mod:`.manager`), and tracing each registration to its plugin
(:mod:`.attribution`). The hooks themselves are in :mod:`skyrl_sdk.hooks`; the process's
registry, built-ins included, is :func:`skyrl_sdk.get_registry`.
"""

from __future__ import annotations

from .manager import ENTRY_POINT_GROUP, ENV_VAR, get_plugins, load_plugins, reset

__all__ = ["ENTRY_POINT_GROUP", "ENV_VAR", "get_plugins", "load_plugins", "reset"]
