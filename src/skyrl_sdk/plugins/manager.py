"""The plugin manager: the built-ins it is handed, plus third-party plugins found through entry points.

Third-party packages declare ``[project.entry-points.skyrl_sdk]``; each entry point names a
module (or object) with ``@skyrl_sdk.hookimpl`` functions. ``SKYRL_SDK_PLUGINS=a,b``
restricts which entry points load (by entry-point or distribution name); an empty value
loads the built-ins only. The built-ins come from the caller (the facade's
:mod:`skyrl_sdk.builtin_plugins`): this layer never imports the engines or samplers above it.

Every plugin is registered with one ``pluggy.PluginManager`` and each registration hook is
called once, through pluggy (``manager.hook.<name>(register=...)``), so hook wrappers,
``tryfirst`` / ``trylast`` and the rest behave as pluggy documents (:mod:`.attribution`
says how each ``register`` call and each failure is traced to its plugin). A plugin that
fails to import or to register is rolled back, reported and skipped; the others still load.
Two plugins registering one name is an error naming both.

The hooks are not historic (pluggy refuses hook wrappers on historic hooks, and wrappers
matter more here), so a plugin object handed to the manager after the hooks ran would never be
called: :class:`SealedPluginManager` refuses it by name instead, saying what to do.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import pluggy

from .. import hooks
from ..errors import DuplicateRegistrationError, PluginError
from ..version import __version__
from .attribution import Registrations, blame, isolate
from .registry import Registry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "skyrl_sdk"
ENV_VAR = "SKYRL_SDK_PLUGINS"
#: Each registration hook, and the :class:`Registry` method its ``register`` callback calls.
REGISTRATION_HOOKS = {
    "skyrl_sdk_register_losses": "register_loss",
    "skyrl_sdk_register_dialects": "register_dialect",
    "skyrl_sdk_register_engines": "register_engine",
    "skyrl_sdk_register_samplers": "register_sampler",
}


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


class SealedPluginManager(pluggy.PluginManager):
    """A ``pluggy.PluginManager`` that refuses registrations once the registration hooks ran
    (they would silently do nothing: the registry was built from that one round of calls)."""

    sealed = False

    def register(self, plugin: object, name: str | None = None) -> str | None:
        if self.sealed:
            raise PluginError(
                f"plugin {name or _module_name(plugin)!r}: skyrl-sdk's registration hooks already ran in this "
                f"process, so a plugin registered now would never be called. Declare its parts in this process "
                f"with @skyrl_sdk.register_loss / register_dialect / register_engine / register_sampler, or "
                f"install it as an entry point (group {ENTRY_POINT_GROUP!r}) and call skyrl_sdk.plugins.reset()")
        return super().register(plugin, name=name)


@attrs.frozen
class LoadedPlugins:
    registry: Registry
    plugins: tuple[PluginInfo, ...]
    manager: pluggy.PluginManager
    #: ``len(hooks.DECLARED)`` when this registry was built (a later declaration rebuilds it)
    declarations: int = 0


@attrs.frozen
class _Candidate:
    name: str
    obj: Any
    package: str
    version: str
    builtin: bool


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


def _module_name(obj: Any) -> str:
    """The module a plugin object is (or was defined in)."""
    return obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")


def _check_hook_names(manager: pluggy.PluginManager, plugin_obj: Any, plugin_name: str) -> None:
    """A misspelt hook would otherwise be ignored silently: fail the plugin instead."""
    unknown = sorted(c.name for c in manager.get_hookcallers(plugin_obj) or () if c.spec is None)
    if unknown:
        known = sorted(n for n in dir(hooks) if n.startswith("skyrl_sdk_"))
        raise PluginError(f"plugin {plugin_name!r} implements unknown hook(s) {unknown}; known hooks: {known}")


def _candidates(builtins: Sequence[Any], infos: list[PluginInfo]) -> tuple[list[_Candidate], set[str]]:
    """The built-ins, then the entry points ``SKYRL_SDK_PLUGINS`` allows (import failures go to
    ``infos``); and the modules of the entry points it leaves out."""
    found = [_Candidate(_module_name(obj), obj, "skyrl-sdk", __version__, True) for obj in builtins]
    allowed = _allowed_entry_points()
    excluded: set[str] = set()
    for ep in _entry_points():
        package, version = _dist_of(ep)
        if allowed is not None and ep.name not in allowed and package not in allowed:
            excluded.add(ep.module)
            continue
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            logger.warning("skyrl-sdk plugin %r (%s %s) failed to import: %r", ep.name, package, version, exc)
            infos.append(PluginInfo(ep.name, package, version, False, (), f"import failed: {exc!r}"))
            continue
        found.append(_Candidate(ep.name, obj, package, version, False))
    return found, excluded


def _fail(candidate: _Candidate, exc: BaseException, infos: list[PluginInfo]) -> None:
    if candidate.builtin:
        raise exc
    logger.warning("skyrl-sdk plugin %r (%s %s) failed to register: %r", candidate.name, candidate.package,
                   candidate.version, exc)
    infos.append(PluginInfo(candidate.name, candidate.package, candidate.version, False, (),
                            f"registration failed: {exc!r}"))


def _call_registration_hooks(manager: pluggy.PluginManager, loaded: dict[str, _Candidate],
                             infos: list[PluginInfo]) -> dict[str, Registry]:
    """Call every registration hook through pluggy; returns what each plugin registered.

    A non-built-in plugin whose hook implementation raises is unregistered, reported, and the
    round runs again without it (the failure stopped the plugins after it in that call)."""
    while True:
        registrations = Registrations(manager)
        try:
            for hook_name, method in REGISTRATION_HOOKS.items():
                getattr(manager.hook, hook_name)(register=registrations.callback(method))
            return registrations.by_plugin
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            culprit = blame(exc, registrations) or isolate(
                manager, REGISTRATION_HOOKS, [n for n, c in loaded.items() if not c.builtin])
            if culprit is None:
                raise
            candidate = loaded.pop(culprit)
            _fail(candidate, exc, infos)
            manager.unregister(name=culprit)


def load_plugins(builtins: Sequence[Any]) -> LoadedPlugins:
    """Build a fresh registry: ``builtins`` (plugin modules or objects, named after their
    module) first, then entry-point plugins sorted by name."""
    manager = SealedPluginManager(ENTRY_POINT_GROUP)
    manager.add_hookspecs(hooks)
    infos: list[PluginInfo] = []
    candidates, excluded = _candidates(builtins, infos)
    loaded: dict[str, _Candidate] = {}
    for candidate in candidates:
        if manager.is_registered(candidate.obj) or manager.get_plugin(candidate.name) is not None:
            continue
        try:
            # pluggy validates hook signatures in register(): a bad one is this plugin's failure.
            manager.register(candidate.obj, name=candidate.name)
            _check_hook_names(manager, candidate.obj, candidate.name)
        except Exception as exc:
            if manager.is_registered(candidate.obj):
                manager.unregister(candidate.obj)
            _fail(candidate, exc, infos)
            continue
        loaded[candidate.name] = candidate
    by_plugin = _call_registration_hooks(manager, loaded, infos)
    manager.sealed = True
    registry = Registry()
    for name, candidate in loaded.items():  # load order: duplicates name the earlier plugin first
        registry.add(by_plugin.get(name, Registry()))
        infos.append(PluginInfo(name, candidate.package, candidate.version, candidate.builtin,
                                tuple(registry.registered_by.get(name, ()))))
    plugin_of = {_module_name(c.obj): (name, c.package, c.version) for name, c in loaded.items()}
    infos = _register_declared(registry, infos, plugin_of, excluded)
    order = {c.name: i for i, c in enumerate(candidates)}
    infos.sort(key=lambda info: order.get(info.name, len(order)))
    return LoadedPlugins(registry=registry, plugins=tuple(infos), manager=manager, declarations=len(hooks.DECLARED))


def _register_declared(registry: Registry, infos: list[PluginInfo], plugin_of: dict[str, tuple[str, str, str]],
                       excluded: set[str]) -> list[PluginInfo]:
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
        own = Registry()
        try:
            for d in declarations:
                getattr(own, f"register_{d.kind}")(plugin, d.name, d.obj, **d.options)
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            logger.warning("skyrl-sdk: registrations declared in %r failed: %r", module, exc)
            infos.append(PluginInfo(plugin, package, version, False, (), f"registration failed: {exc!r}"))
            continue
        registry.add(own)
        registered = tuple(registry.registered_by.get(plugin, ()))
        infos = [attrs.evolve(i, registered=registered) if i.name == plugin and i.error is None else i for i in infos]
        if module not in plugin_of:
            infos.append(PluginInfo(plugin, package, version, False, registered))
    return infos


_lock = threading.Lock()
_cache: dict[tuple[str | None, tuple[Any, ...]], LoadedPlugins] = {}


def get_plugins(builtins: Sequence[Any]) -> LoadedPlugins:
    """The process-wide plugin state for these ``builtins`` (loaded once per value of
    ``SKYRL_SDK_PLUGINS``, and again after a decorator of :mod:`skyrl_sdk.hooks` declared
    something new)."""
    key = (os.environ.get(ENV_VAR), tuple(builtins))
    with _lock:
        loaded = _cache.get(key)
        if loaded is None or loaded.declarations != len(hooks.DECLARED):
            loaded = _cache[key] = load_plugins(builtins)
        return loaded


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin at run time)."""
    with _lock:
        _cache.clear()
