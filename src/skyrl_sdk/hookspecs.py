"""Hook specifications: the ways a plugin extends skyrl-sdk (losses, dialects, engines, samplers).

Each hook receives a ``register`` callback, so a plugin never touches registry internals.
The built-in losses, dialects, the local engine and the transformers sampler are registered
through these very hooks.
Hooks are called once per process, the first time the registry is needed (each FSDP rank
included), in plugin load order.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("skyrl_sdk")
hookimpl = pluggy.HookimplMarker("skyrl_sdk")


@hookspec
def skyrl_sdk_register_losses(register):
    """Register loss functions.

    Call ``register(name, fn, *, description, required_inputs, optional_inputs=(),
    config_cls=None, outputs=("logprobs",), role="policy", prepare=None,
    accepts_topk_targets=False)`` once per loss. ``fn(loss_input, config) -> LossOutput``
    works on packed tokens (see ``skyrl_sdk.losses.base``); ``config_cls`` is a frozen
    attrs class whose fields (with defaults and validators) are the loss's config keys.
    Malformed registrations raise ``PluginError`` at registration time.
    """


@hookspec
def skyrl_sdk_register_dialects(register):
    """Register config dialects: how a client's loss names and configs map onto canonical losses.

    Call ``register(name, convert, *, description='')`` where
    ``convert(loss_fn, loss_fn_config, role) -> (canonical_name, config_dict) | None``.
    Returning ``None`` means "not one of my names": the name then falls through to the
    canonical loss registry with the config unchanged.
    """


@hookspec(warn_on_impl=DeprecationWarning(
    "skyrl_sdk_register_converters is deprecated and will be removed in skyrl-sdk 0.3: "
    "rename the hook to skyrl_sdk_register_dialects (same register callback)"
))
def skyrl_sdk_register_converters(register):
    """Deprecated name of :func:`skyrl_sdk_register_dialects` (same ``register`` callback).

    Call ``register(name, convert, *, description='')``; kept working for one release.
    """


@hookspec
def skyrl_sdk_register_engines(register):
    """Register execution engines.

    Call ``register(name, factory, *, description='')``; ``factory(**engine_kwargs)`` returns an
    object implementing ``skyrl_sdk.engines.base.Engine``. The Backend calls it with
    ``model``, ``role``, ``lora``, ``seed``, ``engine_config`` keyword arguments.
    """


@hookspec
def skyrl_sdk_register_samplers(register):
    """Register samplers: what serves ``Backend.sample`` (and the server's sampling clients).

    Call ``register(name, factory, *, description='')``; ``Backend(sampler=name)`` selects one
    (``"transformers"``, the built-in, by default). The Backend calls
    ``factory(engine=..., config=...)`` on its first ``sample`` with its engine (whose weights
    are the ones to sample from) and its ``sampler_config`` dict; the result has
    ``sample(prompts, params, num_samples, *, prompt_logprobs, topk_prompt_logprobs)``
    returning one ``SampleOutput`` per prompt, and ``close()``.
    """
