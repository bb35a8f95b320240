"""The built-in plugins, handed to the plugin manager from here, and the process's registry.

The built-in losses, dialects, the ``local`` engine and the ``transformers`` sampler are
plain plugins (docs/hooks.md). They live in layers above :mod:`skyrl_sdk.plugins`, so the
plugin manager never imports them: this facade module lists them and passes them in.
Everything that needs the registry (the Backend, ``evaluate_loss``, the CLI, the server, an
engine plugin's ranks) asks :func:`get_registry` here.
"""

from __future__ import annotations

from types import ModuleType

from .plugins import manager
from .plugins.manager import LoadedPlugins, reset  # noqa: F401  (reset: forget them, for tests and notebooks)
from .plugins.registry import Registry


def builtin_plugins() -> tuple[ModuleType, ...]:
    """The built-in plugin modules, in load order (each registers through the hooks)."""
    from . import sampling
    from .engines import local
    from .losses import critic, dialects, policy, sft

    return (sft, policy, critic, dialects, local, sampling)


def builtin_plugin_names() -> tuple[str, ...]:
    """The built-ins' plugin names (their module names), as ``skyrl-sdk plugins`` shows them."""
    return tuple(module.__name__ for module in builtin_plugins())


def get_plugins() -> LoadedPlugins:
    """The built-ins and the entry-point plugins, loaded once per process (see
    :func:`skyrl_sdk.plugins.manager.get_plugins`; :func:`skyrl_sdk.plugins.reset` forgets them)."""
    return manager.get_plugins(builtin_plugins())


def get_registry() -> Registry:
    """The process's registry of losses, dialects, engines and samplers."""
    return get_plugins().registry
