"""The plugin manager: the built-ins it is handed, plus third-party plugins found through entry points.

Third-party packages declare ``[project.entry-points.skyrl_sdk]``; each entry point names a
module (or object) with ``@skyrl_sdk.hookimpl`` functions. ``SKYRL_SDK_PLUGINS=a,b``
restricts which entry points load (by entry-point or distribution name); an empty value
loads the built-ins only. The built-ins come from the caller (the facade's
:mod:`skyrl_sdk.builtin_plugins`): this layer never imports the engines or samplers above it.

Every plugin is registered with one ``pluggy.PluginManager`` (as its attributed view:
:mod:`.attribution` says how each ``register`` call and each failure is traced to its plugin)
and each registration hook is called once, through pluggy (``manager.hook.<name>(register=...)``),
so hook wrappers, ``tryfirst`` / ``trylast`` and the rest behave as pluggy documents. What the
decorators of :mod:`skyrl_sdk.hooks` declared takes the same path: a module's declarations are
hook implementations of its plugin (an entry point's, or the module's own for a script); one
made after the hooks ran is registered by calling its module's new implementations alone,
so no hook runs twice. A plugin that fails to import or to register is rolled back, reported
and skipped; the others still load. Two plugins registering one name is an error naming both.

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
from .attribution import Registrations, attributed, isolate
from .registry import Registry

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "skyrl_sdk"
ENV_VAR = "SKYRL_SDK_PLUGINS"
#: the package :class:`PluginInfo` shows for a module that declared in this process (no entry point)
DECLARED_HERE = "(declared in this process)"
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
    """A ``pluggy.PluginManager`` that refuses registrations from outside once the registration
    hooks ran (they would silently do nothing: the registry was built from that one round of
    calls). The manager itself adds the views of later declarations (:func:`_add_declarations`)."""

    sealed = False

    def register(self, plugin: object, name: str | None = None) -> str | None:
        if self.sealed:
            raise PluginError(
                f"plugin {name or _module_name(plugin)!r}: skyrl-sdk's registration hooks already ran in this "
                f"process, so a plugin registered now would never be called. Declare its parts in this process "
                f"with @skyrl_sdk.register_loss / register_dialect / register_engine / register_sampler, or "
                f"install it as an entry point (group {ENTRY_POINT_GROUP!r}) and call skyrl_sdk.plugins.reset()")
        return super().register(plugin, name=name)

    def _admit(self, plugin: object, name: str) -> None:
        """Register a view of declarations made after the hooks ran (:func:`_add_declarations`)."""
        super().register(plugin, name=name)


@attrs.frozen
class LoadedPlugins:
    registry: Registry
    plugins: tuple[PluginInfo, ...]
    manager: SealedPluginManager
    #: ``hooks.DECLARED`` as it was registered (a later declaration is added to this state)
    declared: tuple[hooks.Declaration, ...] = ()
    #: what each plugin registered, by plugin name in load order (the registry is their union)
    by_plugin: tuple[tuple[str, Registry], ...] = ()
    #: module -> (plugin, package, version) of the entry-point plugins, and the modules of the
    #: entry points ``SKYRL_SDK_PLUGINS`` leaves out (their declarations are left out too)
    plugin_of: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    excluded: frozenset[str] = frozenset()


@attrs.frozen
class _Candidate:
    name: str
    #: the plugin module or object (None: a module that only declares, with the decorators)
    obj: Any
    package: str
    version: str
    builtin: bool
    #: what its module declared with the decorators of :mod:`skyrl_sdk.hooks`
    declarations: tuple[hooks.Declaration, ...] = ()


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


def _with_declarations(candidates: list[_Candidate], declared: Sequence[hooks.Declaration],
                       excluded: set[str]) -> list[_Candidate]:
    """``candidates`` with what their modules declared, then a candidate for each other module
    that declared something (a script, a notebook), named after it; the declarations of the
    entry points ``SKYRL_SDK_PLUGINS`` leaves out are left out too."""
    by_module: dict[str, list[hooks.Declaration]] = {}
    for d in declared:
        if d.module not in excluded:
            by_module.setdefault(d.module, []).append(d)
    out = []
    for c in candidates:
        out.append(attrs.evolve(c, declarations=tuple(by_module.pop(_module_name(c.obj), ()))))
    out += [_Candidate(module, None, DECLARED_HERE, "", False, tuple(ds)) for module, ds in by_module.items()]
    return out


def _call_registration_hooks(manager: pluggy.PluginManager, loaded: dict[str, _Candidate],
                             infos: list[PluginInfo]) -> dict[str, Registry]:
    """Call every registration hook through pluggy; returns what each plugin registered.

    A non-built-in plugin whose hook implementation raises is unregistered, reported, and the
    round runs again without it (the failure stopped the plugins after it in that call)."""
    while True:
        registrations = Registrations()
        try:
            for hook_name, method in REGISTRATION_HOOKS.items():
                registrations.call(getattr(manager.hook, hook_name), method)
            return registrations.by_plugin
        except DuplicateRegistrationError:
            raise
        except Exception as exc:
            culprit = registrations.blame(exc) or isolate(
                manager, REGISTRATION_HOOKS, [n for n, c in loaded.items() if not c.builtin])
            if culprit is None:
                raise
            candidate = loaded.pop(culprit)
            _fail(candidate, exc, infos)
            manager.unregister(name=culprit)


def load_plugins(builtins: Sequence[Any]) -> LoadedPlugins:
    """Build a fresh registry: ``builtins`` (plugin modules or objects, named after their
    module) first, then entry-point plugins sorted by name, then the modules that declared
    registrations with the decorators; each handed to pluggy as an attributed view
    (:func:`~.attribution.attributed`), and every registration made through its hooks."""
    manager = SealedPluginManager(ENTRY_POINT_GROUP)
    manager.add_hookspecs(hooks)
    infos: list[PluginInfo] = []
    candidates, excluded = _candidates(builtins, infos)
    declared = tuple(hooks.DECLARED)
    candidates = _with_declarations(candidates, declared, excluded)
    loaded: dict[str, _Candidate] = {}
    seen: set[int] = set()  # a plugin object named by two entry points is registered once
    for candidate in candidates:
        if (candidate.obj is not None and id(candidate.obj) in seen) or manager.get_plugin(candidate.name) is not None:
            continue
        view = attributed(candidate.obj, candidate.name, candidate.declarations)
        try:
            # pluggy validates hook signatures in register(): a bad one is this plugin's failure.
            manager.register(view, name=candidate.name)
            _check_hook_names(manager, view, candidate.name)
        except Exception as exc:
            if manager.is_registered(view):
                manager.unregister(view)
            _fail(candidate, exc, infos)
            continue
        seen.add(id(candidate.obj))
        loaded[candidate.name] = candidate
    by_plugin = _call_registration_hooks(manager, loaded, infos)
    manager.sealed = True
    registry = Registry()
    own = []
    for name, candidate in loaded.items():  # load order: duplicates name the earlier plugin first
        own.append((name, by_plugin.get(name, Registry())))
        registry.add(own[-1][1])
        infos.append(PluginInfo(name, candidate.package, candidate.version, candidate.builtin,
                                tuple(registry.registered_by.get(name, ()))))
    order = {c.name: i for i, c in enumerate(candidates)}
    infos.sort(key=lambda info: order.get(info.name, len(order)))
    plugin_of = tuple((_module_name(c.obj), (name, c.package, c.version)) for name, c in loaded.items()
                      if c.obj is not None)
    return LoadedPlugins(registry=registry, plugins=tuple(infos), manager=manager, declared=declared,
                         by_plugin=tuple(own), plugin_of=plugin_of, excluded=frozenset(excluded))


def _add_declarations(state: LoadedPlugins) -> LoadedPlugins:
    """``state`` with the declarations made since it was loaded: each declaring module's new
    ones handed to pluggy as a view of their own (under its plugin, or its name) whose hooks
    alone are called, so no hook that already ran runs again. A module's declarations succeed
    or fail together; a name another plugin has raises ``DuplicateRegistrationError`` and
    changes nothing."""
    manager = state.manager
    plugin_of = dict(state.plugin_of)
    by_plugin = dict(state.by_plugin)
    infos = list(state.plugins)
    by_module: dict[str, list[hooks.Declaration]] = {}
    for d in hooks.DECLARED[len(state.declared):]:
        if d.module not in state.excluded:
            by_module.setdefault(d.module, []).append(d)
    added = []
    try:
        for module, declarations in by_module.items():
            plugin, package, version = plugin_of.get(module, (module, DECLARED_HERE, ""))
            view = attributed(None, plugin, declarations)
            manager._admit(view, _free_name(manager, plugin))
            added.append(view)
            registrations = Registrations()
            others = [p for p in manager.get_plugins() if p is not view]
            try:
                for hook_name, method in REGISTRATION_HOOKS.items():
                    registrations.call(manager.subset_hook_caller(hook_name, others), method)
            except DuplicateRegistrationError:
                raise
            except Exception as exc:
                manager.unregister(view)
                added.remove(view)
                logger.warning("skyrl-sdk: registrations declared in %r failed: %r", module, exc)
                infos.append(PluginInfo(plugin, package, version, False, (), f"registration failed: {exc!r}"))
                continue
            merged = Registry()
            for part in (by_plugin.get(plugin), registrations.by_plugin.get(plugin)):
                if part is not None:
                    merged.add(part)
            by_plugin[plugin] = merged
        registry = Registry()
        for own in by_plugin.values():
            registry.add(own)
    except BaseException:
        for view in added:
            manager.unregister(view)
        raise
    for plugin in {plugin_of.get(m, (m,))[0] for m in by_module}:
        infos = _with_registered(infos, plugin, plugin_of, registry)
    return attrs.evolve(state, registry=registry, plugins=tuple(infos), declared=tuple(hooks.DECLARED),
                        by_plugin=tuple(by_plugin.items()))


def _free_name(manager: pluggy.PluginManager, plugin: str) -> str:
    """``plugin``, or ``plugin (2)``, ... : a name pluggy does not hold yet."""
    name, n = plugin, 1
    while manager.get_plugin(name) is not None or manager.is_blocked(name):
        n += 1
        name = f"{plugin} ({n})"
    return name


def _with_registered(infos: list[PluginInfo], plugin: str, plugin_of: dict[str, tuple[str, str, str]],
                     registry: Registry) -> list[PluginInfo]:
    """``infos`` with ``plugin``'s row showing what it registered now (a new row if it had none)."""
    registered = tuple(registry.registered_by.get(plugin, ()))
    if not registered:
        return infos
    if any(i.name == plugin and i.error is None for i in infos):
        return [attrs.evolve(i, registered=registered) if i.name == plugin and i.error is None else i for i in infos]
    package, version = next(((p, v) for n, p, v in plugin_of.values() if n == plugin), (DECLARED_HERE, ""))
    return [*infos, PluginInfo(plugin, package, version, False, registered)]


_lock = threading.Lock()
_cache: dict[tuple[str | None, tuple[Any, ...]], LoadedPlugins] = {}


def get_plugins(builtins: Sequence[Any]) -> LoadedPlugins:
    """The process-wide plugin state for these ``builtins``: loaded once per value of
    ``SKYRL_SDK_PLUGINS`` (every hook called once), and extended, calling only their own hooks,
    by what the decorators of :mod:`skyrl_sdk.hooks` declared since."""
    key = (os.environ.get(ENV_VAR), tuple(builtins))
    with _lock:
        loaded = _cache.get(key)
        if loaded is None or hooks.DECLARED[:len(loaded.declared)] != list(loaded.declared):
            loaded = _cache[key] = load_plugins(builtins)  # first use, or declarations withdrawn (tests)
        elif len(hooks.DECLARED) > len(loaded.declared):
            loaded = _cache[key] = _add_declarations(loaded)
        return loaded


def reset() -> None:
    """Forget the loaded plugins (tests, or after installing a plugin at run time)."""
    with _lock:
        _cache.clear()
