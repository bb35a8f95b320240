"""Hook specifications: the ways a plugin extends skyrl-sdk (losses, dialects, engines, samplers).

Each hook receives a ``register`` callback, so a plugin never touches registry internals.
The built-in losses, dialects, the local engine and the transformers sampler are registered
through these very hooks. The decorators at the end (``register_loss`` and its siblings) are
sugar over them: they declare a registration, and the plugin manager makes it through the
same hooks (a module's declarations are hook implementations of its plugin).
Each hook implementation is called once per process (each FSDP rank included), through
pluggy: the first time the registry is needed, every one; a declaration made after that, its
own module's alone (the rest are not called again); all again only after
``skyrl_sdk.plugins.reset()`` or for a new value of ``SKYRL_SDK_PLUGINS``. ``tryfirst`` /
``trylast`` and hook wrappers behave as pluggy documents, and each ``register`` call is filed
under the plugin whose implementation made it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pluggy

#: pluggy's project name for these hooks (the entry-point group too)
PROJECT = "skyrl_sdk"

#: the ``register`` callback a hook is handed: ``register(name, what, **keywords)`` (the
#: keywords of each hook: its docstring, docs/hooks.md)
Register = Callable[..., None]

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def skyrl_sdk_register_losses(register: Register) -> None:
    """Register loss functions.

    Call ``register(name, fn, *, description, required_inputs, optional_inputs=(),
    config_cls=None, outputs=("logprobs",), role="policy", prepare=None,
    accepts_topk_targets=False, needs_provenance=False)`` once per loss.
    ``fn(loss_input, config) -> LossOutput`` works on packed tokens (see
    ``skyrl_sdk.losses.base``); ``config_cls`` is a frozen attrs class whose fields (with
    defaults and validators) are the loss's config keys.
    Malformed registrations raise ``PluginError`` at registration time.
    """


@hookspec
def skyrl_sdk_register_dialects(register: Register) -> None:
    """Register config dialects: how a client's loss names and configs map onto native losses.

    Call ``register(name, convert, *, description='')`` where
    ``convert(loss_fn, loss_fn_config, role) -> (native_name, config_dict) | None``.
    Returning ``None`` means "not one of my names": the name then falls through to the
    native loss registry with the config unchanged.
    """


@hookspec
def skyrl_sdk_register_engines(register: Register) -> None:
    """Register execution engines.

    Call ``register(name, factory, *, description='')``; ``factory(**engine_kwargs)`` returns an
    object implementing ``skyrl_sdk.engines.base.Engine`` (an abstract class: a subclass missing
    a required method is refused here). The Backend calls it with
    ``model``, ``role``, ``lora``, ``seed``, ``engine_config`` keyword arguments.
    """


@hookspec
def skyrl_sdk_register_samplers(register: Register) -> None:
    """Register samplers: what serves ``Backend.sample`` (and the server's sampling clients).

    Call ``register(name, factory, *, description='')``; ``Backend(sampler=name)`` selects one
    (``"transformers"``, the built-in, by default). ``factory`` is a subclass of
    ``skyrl_sdk.sampling.Sampler`` (the registry refuses a class that is not) or a callable
    returning one. The Backend calls ``factory(source=..., config=...)`` on its first ``sample``
    with its engine's ``WeightsSource`` (the weights to sample from, never the engine) and its
    ``sampler_config`` dict; the result's ``sample(request)`` gets a ``SampleRequest`` and
    returns one ``SampleOutput`` per prompt (docs/engines.md, Samplers).
    """


# ---- decorators: sugar over the hooks -------------------------------------------------------
class Declaration(NamedTuple):
    """One registration made with a decorator below, waiting for the plugin manager."""

    module: str  #: the module the decorated object was defined in
    kind: str  #: "loss", "dialect", "engine" or "sampler"
    name: str
    obj: Any
    options: dict


#: Every declaration made so far, in order. The plugin manager registers them each time it
#: builds a registry (a new declaration makes the next ``get_registry()`` rebuild it).
DECLARED: list[Declaration] = []


def _declare(kind: str, name: str, options: dict) -> Callable[[Any], Any]:
    def decorate(obj: Any) -> Any:
        DECLARED.append(Declaration(getattr(obj, "__module__", "__main__"), kind, name, obj, dict(options)))
        return obj

    return decorate


def register_loss(name: str, **options: Any) -> Callable[[Any], Any]:
    """Decorator: register ``fn(loss_input, config)`` as loss ``name``.

    ``options`` are the keyword arguments of the :func:`skyrl_sdk_register_losses` callback
    (``description``, ``required_inputs``, ``optional_inputs``, ``config_cls``, ...)::

        @skyrl_sdk.register_loss("clipped_sq_adv", description="...", required_inputs=("advantages",))
        def clipped_sq_adv(batch, config): ...

    In a plugin's entry-point module it registers under that plugin; anywhere else (a script,
    a notebook) under the defining module's name, in this process only (FSDP ranks that run
    in other processes load entry-point plugins only).
    """
    return _declare("loss", name, options)


def register_dialect(name: str, **options: Any) -> Callable[[Any], Any]:
    """Decorator: register ``convert(loss_fn, loss_fn_config, role)`` as dialect ``name``
    (options as :func:`skyrl_sdk_register_dialects`'s callback takes them)."""
    return _declare("dialect", name, options)


def register_engine(name: str, **options: Any) -> Callable[[Any], Any]:
    """Decorator: register an engine factory (usually a subclass of
    ``skyrl_sdk.engines.Engine``) as engine ``name``."""
    return _declare("engine", name, options)


def register_sampler(name: str, **options: Any) -> Callable[[Any], Any]:
    """Decorator: register a sampler factory as sampler ``name``."""
    return _declare("sampler", name, options)
