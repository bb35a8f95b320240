"""Which plugin made a registration, and which plugin broke a hook call.

pluggy calls every implementation of a hook in one call and passes them all the same
``register`` callback. The plugin behind each ``register(...)`` is the one whose hook
implementation is running: the innermost frame on the stack whose code is a registered
implementation (a hook wrapper's generator frame included, while it runs). A failure is
traced the same way through its traceback; when that names no implementation (pluggy's
own errors, such as a wrapper that never yields), each plugin's implementations are called
alone until one fails.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import pluggy

from ..errors import PluginError
from .registry import Registry


def _implementations(manager: pluggy.PluginManager) -> dict[int, list[tuple[Any, str]]]:
    """``id`` of the code object of every hook implementation -> the plugins (object, name) it
    belongs to. By identity: code objects of the same source in two modules compare equal."""
    codes: dict[int, list[tuple[Any, str]]] = {}
    for plugin in manager.get_plugins():
        for caller in manager.get_hookcallers(plugin) or ():
            for impl in caller.get_hookimpls():
                code = getattr(impl.function, "__code__", None)
                owner = (plugin, impl.plugin_name)
                if impl.plugin is plugin and code is not None and owner not in codes.get(id(code), []):
                    codes.setdefault(id(code), []).append(owner)
    return codes


class Registrations:
    """What each plugin registered during one round of hook calls, kept apart per plugin (a
    :class:`Registry` each, which checks every registration as it is made)."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self.codes = _implementations(manager)
        self.by_plugin: dict[str, Registry] = {}

    def plugin_of(self, frames: Iterable[FrameType]) -> str | None:
        """The plugin of the first frame (innermost first) that runs a hook implementation."""
        for frame in frames:
            owners = self.codes.get(id(frame.f_code))
            if owners:
                if len(owners) > 1:  # one function shared by plugin objects: a method's ``self`` tells
                    me = frame.f_locals.get("self")
                    owners = [o for o in owners if o[0] is me] or owners
                return owners[0][1]
        return None

    def callback(self, method: str) -> Callable[..., Any]:
        """The ``register`` callback of one hook: ``Registry.<method>`` under the calling plugin."""

        def register(*args: Any, **kwargs: Any) -> Any:
            plugin = self.plugin_of(_stack(inspect.currentframe()))
            if plugin is None:
                raise PluginError("register(...) was called outside a skyrl_sdk hook implementation")
            return getattr(self.by_plugin.setdefault(plugin, Registry()), method)(plugin, *args, **kwargs)

        return register


def _stack(frame: FrameType | None) -> Iterable[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def blame(exc: BaseException, registrations: Registrations) -> str | None:
    """The plugin whose hook implementation raised ``exc``: the innermost implementation frame
    of its traceback, or None when it names none."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return registrations.plugin_of(reversed(frames))


def isolate(manager: pluggy.PluginManager, hook_methods: Mapping[str, str], suspects: list[str]) -> str | None:
    """The first of ``suspects`` whose implementations fail when called without the other
    suspects (the rest, the built-ins, still run), or None."""
    for suspect in suspects:
        others = [p for name in suspects if name != suspect and (p := manager.get_plugin(name)) is not None]
        registrations = Registrations(manager)
        try:
            for hook_name, method in hook_methods.items():
                manager.subset_hook_caller(hook_name, others)(register=registrations.callback(method))
        except Exception:
            return suspect
    return None
