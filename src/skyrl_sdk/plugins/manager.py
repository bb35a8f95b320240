"""The plugin manager: built-ins plus third-party plugins found through entry points.

Third-party packages declare ``[project.entry-points.skyrl_sdk]``; each entry point names a
module (or object) with ``@skyrl_sdk.hookimpl`` functions. ``SKYRL_SDK_PLUGINS=a,b``
restricts which entry points load (by entry-point or distribution name); an empty value
loads the built-ins only. A plugin that fails to import or to register is reported and
skipped; the others still load. Two plugins registering one name is an error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
import threading
from typing import Any

import attrs
import pluggy

from .. import hooks
from ..errors import DuplicateRegistrationError, PluginError
from ..version import __version__
from .registry import Registry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "skyrl_sdk"
ENV_VAR = "SKYRL_SDK_PLUGINS"

BUILTIN_PLUGINS = (
    "skyrl_sdk.losses.sft",
    "skyrl_sdk.losses.policy",
    "skyrl_sdk.losses.critic",
    "skyrl_sdk.losses.stable",
    "skyrl_sdk.losses.dialects",
    "skyrl_sdk.engines.local",
    "skyrl_sdk.sampling",
)


@attrs.frozen
class PluginInfo:
    """What ``skyrl-sdk plugins`` shows for one plugin."""

    name: str
    package: str
    version: str
    builtin: bool
    registered: tuple[str, ...] = ()
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True, value_serializer=lambda i, a, v: list(v) if isinstance(v, tuple) else v)


@attrs.frozen
class LoadedPlugins:
    registry: Registry
    plugins: tuple[PluginInfo, ...]
    manager: pluggy.PluginManager
    #: ``len(hooks.DECLARED)`` when this registry was built (a later declaration rebuilds it)
    declarations: int = 0


def _allowed_entry_points() -> set[str] | None:
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("unknown", "unknown")
    return (dist.metadata["Name"] or "unknown", dist.version or "unknown")


def _call_plugin_hooks(manager: pluggy.PluginManager, plugin_obj: Any, plugin_name: str, registry: Registry) -> None:
    """Run this plugin's own hook implementations, each with a register bound to it."""
    callbacks = {
        "skyrl_sdk_register_losses": lambda *a, **k: registry.register_loss(plugin_name, *a, **k),
        "skyrl_sdk_register_dialects": lambda *a, **k: registry.register_dialect(plugin_name, *a, **k),
        "skyrl_sdk_register_engines": lambda *a, **k: registry.register_engine(plugin_name, *a, **k),
        "skyrl_sdk_register_samplers": lambda *a, **k: registry.register_sampler(plugin_name, *a, **k),
    }
    for hook_name, register in callbacks.items():
        caller = getattr(manager.hook, hook_name)
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin_obj:
                impl.function(register=register)


def _check_hook_names(manager: pluggy.PluginManager, plugin_obj: Any, plugin_name: str) -> None:
    """A misspelt hook would otherwise be ignored silently: fail the plugin instead."""
    unknown = sorted(c.name for c in manager.get_hookcallers(plugin_obj) or () if c.spec is None)
    if unknown:
        known = sorted(n for n in dir(hooks) if n.startswith("skyrl_sdk_"))
        raise PluginError(f"plugin {plugin_name!r} implements unknown hook(s) {unknown}; known hooks: {known}")


def _snapshot(registry: Registry) -> Registry:
    return Registry(
        losses=dict(registry.losses),
        dialects=dict(registry.dialects),
        engines=dict(registry.engines),
        samplers=dict(registry.samplers),
        owners=dict(registry.owners),
        registered_by={k: list(v) for k, v in registry.registered_by.items()},
    )


def load_plugins() -> LoadedPlugins:
    """Build a fresh registry: built-ins first, then entry-point plugins (sorted by name)."""
    manager = pluggy.PluginManager(ENTRY_POINT_GROUP)
    manager.add_hookspecs(hooks)
    registry = Registry()
    infos: list[PluginInfo] = []
    version = __version__

    candidates: list[tuple[str, Any, str, str, bool]] = []
    for module_name in BUILTIN_PLUGINS:
        module = importlib.import_module(module_name)
        candidates.append((module_name, module, "skyrl-sdk", version, True))

    allowed = _allowed_entry_points()
    excluded: set[str] = set()  # modules of entry points SKYRL_SDK_PLUGINS leaves out
    for ep in _entry_points():
        package, ep_version = _dist_of(ep)
        if allowed is not None and ep.name not in allowed and package not in allowed:
            excluded.add(ep.module)
            continue
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            logger.warning("skyrl-sdk plugin %r (%s %s) failed to import: %r", ep.name, package, ep_version, exc)
            infos.append(PluginInfo(ep.name, package, ep_version, False, (), f"import failed: {exc!r}"))
            continue
        candidates.append((ep.name, obj, package, ep_version, False))

    for name, obj, package, pkg_version, builtin in candidates:
        if manager.is_registered(obj) or manager.get_plugin(name) is not None:
            continue
        before = _snapshot(registry)
        try:
            # pluggy validates hook signatures in register(): a bad one is this plugin's failure.
            manager.register(obj, name=name)
            _check_hook_names(manager, obj, name)
            _call_plugin_hooks(manager, obj, name, registry)
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            if builtin:
                raise
            logger.warning("skyrl-sdk plugin %r (%s %s) failed to register: %r", name, package, pkg_version, exc)
            registry = before
            if manager.is_registered(obj):
                manager.unregister(obj)
            infos.append(PluginInfo(name, package, pkg_version, False, (), f"registration failed: {exc!r}"))
            continue
        infos.append(PluginInfo(name, package, pkg_version, builtin, tuple(registry.registered_by.get(name, ()))))
    plugin_of = {_module_name(obj): (name, package, pkg_version) for name, obj, package, pkg_version, _ in candidates
                 if manager.is_registered(obj)}
    registry, infos = _register_declared(registry, infos, plugin_of, excluded)
    return LoadedPlugins(registry=registry, plugins=tuple(infos), manager=manager, declarations=len(hooks.DECLARED))


def _module_name(obj: Any) -> str:
    """The module an entry point's object is (or was defined in)."""
    return obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")


def _register_declared(registry: Registry, infos: list[PluginInfo], plugin_of: dict[str, tuple[str, str, str]],
                       excluded: set[str]) -> tuple[Registry, list[PluginInfo]]:
    """Register what the decorators of :mod:`skyrl_sdk.hooks` declared: under the plugin whose
    entry-point module declared it, or (a script, a notebook) under the declaring module's
    name. A module's declarations succeed or fail together, like a plugin's hooks."""
    by_module: dict[str, list[hooks.Declaration]] = {}
    for declaration in list(hooks.DECLARED):
        if declaration.module not in excluded:
            by_module.setdefault(declaration.module, []).append(declaration)
    infos = list(infos)
    for module, declarations in by_module.items():
        plugin, package, version = plugin_of.get(module, (module, "(declared in this process)", ""))
        before = _snapshot(registry)
        try:
            for d in declarations:
                getattr(registry, f"register_{d.kind}")(plugin, d.name, d.obj, **d.options)
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            logger.warning("skyrl-sdk: registrations declared in %r failed: %r", module, exc)
            registry = before
            infos.append(PluginInfo(plugin, package, version, False, (), f"registration failed: {exc!r}"))
            continue
        registered = tuple(registry.registered_by.get(plugin, ()))
        infos = [attrs.evolve(i, registered=registered) if i.name == plugin and i.error is None else i for i in infos]
        if module not in plugin_of:
            infos.append(PluginInfo(plugin, package, version, False, registered))
    return registry, infos


_lock = threading.Lock()
_cache: dict[str | None, LoadedPlugins] = {}


def get_plugins() -> LoadedPlugins:
    """The process-wide plugin state (loaded once per value of ``SKYRL_SDK_PLUGINS``, and again
    after a decorator of :mod:`skyrl_sdk.hooks` declared something new)."""
    key = os.environ.get(ENV_VAR)
    with _lock:
        loaded = _cache.get(key)
        if loaded is None or loaded.declarations != len(hooks.DECLARED):
            loaded = _cache[key] = load_plugins()
        return loaded


def get_registry() -> Registry:
    return get_plugins().registry


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin at run time)."""
    with _lock:
        _cache.clear()
