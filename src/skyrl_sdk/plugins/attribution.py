"""Which plugin made a registration, and which plugin broke a hook call, from what pluggy is
given, never from the stack.

The manager hands pluggy each plugin as an :func:`attributed` view: a module holding the
plugin's hook implementations (and the registrations its decorators declared, as hook
implementations of their own), each wrapped so that while it runs (every step of a hook
wrapper included) its plugin is the current one, a context variable. pluggy records each
implementation under the plugin (``HookImpl.plugin_name``) and calls them in its own order,
wrappers around the rest; the one ``register`` callback every implementation receives files
each call under the current plugin (a helper it calls included), and an exception leaving an
implementation is charged to its plugin (the first to see it: the one that raised it). When a
failure was raised by no implementation (pluggy's own errors), each plugin's implementations
are called alone until one fails (:func:`isolate`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import pluggy

from .. import hooks
from ..errors import PluginError
from .registry import Registry

#: the plugin whose hook implementation is running (None: none is)
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("skyrl_sdk_plugin", default=None)
#: the round of hook calls in progress, which records whose implementation raised what
_round: contextvars.ContextVar[Registrations | None] = contextvars.ContextVar("skyrl_sdk_round", default=None)

#: the hook each decorator kind declares through
DECLARED_HOOKS = {"loss": "skyrl_sdk_register_losses", "dialect": "skyrl_sdk_register_dialects",
                  "engine": "skyrl_sdk_register_engines", "sampler": "skyrl_sdk_register_samplers"}
_MARK = f"{hooks.PROJECT}_impl"


class _RunningAs:
    """While entered, ``plugin`` is the current plugin; an exception leaving it is charged to
    ``plugin`` unless an implementation inside already was."""

    def __init__(self, plugin: str) -> None:
        self.plugin = plugin

    def __enter__(self) -> None:
        self.token = _current.set(self.plugin)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        _current.reset(self.token)
        if exc is not None and (current := _round.get()) is not None:
            current.charge(exc, self.plugin)


def _as_plugin(plugin: str, fn: Callable[..., Any], opts: Mapping[str, Any]) -> Callable[..., Any]:
    """``fn`` (a hook implementation with marker options ``opts``) run as ``plugin``; pluggy reads
    its signature through ``__wrapped__``."""
    if not ((opts.get("wrapper") or opts.get("hookwrapper")) and inspect.isgeneratorfunction(fn)):
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with _RunningAs(plugin):
                return fn(*args, **kwargs)
    else:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Iterator[Any]:
            return (yield from _wrapper_steps(plugin, fn, args, kwargs))
    setattr(call, _MARK, dict(opts))
    return call


def _wrapper_steps(plugin: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Iterator[Any]:
    """A hook wrapper's steps, each run as ``plugin``: up to its one ``yield``, then from it to
    its end; a wrapper that never yields, or yields twice, fails naming the plugin."""
    what = f"plugin {plugin!r}: its hook wrapper {getattr(fn, '__qualname__', fn)!r}"
    with _RunningAs(plugin):
        gen = fn(*args, **kwargs)
        try:
            first = next(gen)
        except StopIteration:
            raise PluginError(f"{what} did not yield") from None
    try:
        sent = yield first
    except GeneratorExit:
        gen.close()
        raise
    except BaseException as exc:  # what the wrapped implementations raised: the wrapper sees it
        with _RunningAs(plugin):
            try:
                gen.throw(exc)
            except StopIteration as stop:
                return stop.value
    else:
        with _RunningAs(plugin):
            try:
                gen.send(sent)
            except StopIteration as stop:
                return stop.value
    gen.close()
    with _RunningAs(plugin):
        raise PluginError(f"{what} has a second yield")


def attributed(obj: Any, plugin: str, declarations: Sequence[hooks.Declaration] = ()) -> ModuleType:
    """What the manager registers with pluggy for plugin ``plugin``: ``obj``'s hook implementations
    (a module or object with ``@skyrl_sdk.hookimpl`` functions; None for a module that only
    declares) and one implementation per kind of ``declarations`` (made with the decorators of
    :mod:`skyrl_sdk.hooks`, calling ``register`` as the hook's callback takes it), each run as
    ``plugin``; its ``origin`` is ``obj``. Misspelt hook names are kept, so that pluggy reports
    them."""
    view = ModuleType(f"skyrl_sdk plugin {plugin}")
    view.__doc__ = f"The hook implementations of plugin {plugin!r}, attributed to it."
    # the plugin module or object itself, on a module object made here (mypy knows no such attribute)
    view.origin = obj  # type: ignore[attr-defined]
    probe = pluggy.PluginManager(hooks.PROJECT)
    for name in dir(obj) if obj is not None else ():
        opts = probe.parse_hookimpl_opts(obj, name)
        if opts is not None:
            setattr(view, name, _as_plugin(plugin, getattr(obj, name), opts))
    for kind, hook in DECLARED_HOOKS.items():
        mine = [d for d in declarations if d.kind == kind]
        if mine:
            setattr(view, f"declared_{kind}s", _as_plugin(plugin, _declared(mine), _marked(hook)))
    return view


def _declared(declarations: list[hooks.Declaration]) -> Callable[[Any], None]:
    def register_declared(register: Any) -> None:
        for d in declarations:
            register(d.name, d.obj, **d.options)

    return register_declared


def _marked(hook: str) -> dict[str, Any]:
    """The marker options of a plain implementation of ``hook`` under another attribute name."""
    @hooks.hookimpl(specname=hook)
    def impl(register: Any) -> None: ...

    return dict(getattr(impl, _MARK))


class Registrations:
    """What each plugin registered during one round of hook calls, kept apart per plugin (a
    :class:`Registry` each, which checks every registration as it is made), and whose
    implementation raised each failure of the round."""

    def __init__(self) -> None:
        self.by_plugin: dict[str, Registry] = {}
        self._charged: list[tuple[BaseException, str]] = []
        self._open = False

    def charge(self, exc: BaseException, plugin: str) -> None:
        if all(e is not exc for e, _ in self._charged):
            self._charged.append((exc, plugin))

    def blame(self, exc: BaseException) -> str | None:
        """The plugin whose implementation raised ``exc``, or None (pluggy raised it)."""
        return next((plugin for e, plugin in self._charged if e is exc), None)

    def call(self, hook: Any, method: str) -> None:
        """Call ``hook`` (a pluggy hook caller) with the ``register`` callback of ``method``, a
        :class:`Registry` method."""
        token, self._open = _round.set(self), True
        try:
            hook(register=self._callback(method))
        finally:
            self._open = False
            _round.reset(token)

    def _callback(self, method: str) -> Callable[..., Any]:
        def register(*args: Any, **kwargs: Any) -> Any:
            plugin = _current.get()
            if plugin is None or not self._open:
                raise PluginError("register(...) was called outside a skyrl_sdk hook implementation")
            return getattr(self.by_plugin.setdefault(plugin, Registry()), method)(plugin, *args, **kwargs)

        return register


def isolate(manager: pluggy.PluginManager, hook_methods: Mapping[str, str], suspects: list[str]) -> str | None:
    """The first of ``suspects`` (names pluggy knows them by) whose implementations fail when
    called without the other suspects (the rest, the built-ins, still run), or None."""
    for suspect in suspects:
        others = [p for name in suspects if name != suspect and (p := manager.get_plugin(name)) is not None]
        registrations = Registrations()
        try:
            for hook_name, method in hook_methods.items():
                registrations.call(manager.subset_hook_caller(hook_name, others), method)
        except Exception:
            return suspect
    return None
