"""Generation from the current weights: our own KV-cached decode loop (see ``decode``).

Returned logprobs are those of the sampled tokens under the model's own distribution
(temperature 1, no top-k / top-p), i.e. what ``forward`` reports for the same tokens, so
they can be fed back as the ``logprobs`` input of RL losses. Stop rules follow Tinker
(``stops``); draws use a per-request ``torch.Generator`` (``draw``); prompt logprobs and the
rescoring of low-precision samples are in ``scores``. This module registers the built-in
``transformers`` sampler (a sampler plugin's factory returns an object with ``sample`` and
``close``, see hooks.py); ``generate`` loads lazily, so plugin loading stays light.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InputError
from ..hooks import hookimpl

__all__ = ["SCORE_OPTIONS", "generate", "unsupported_options"]

#: Tinker's optional scores beyond prompt logprobs, passed to samplers (and engines) as keyword
#: arguments only when asked for, so one that does not take them still serves every other request
SCORE_OPTIONS = ("topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k")


def __getattr__(name: str) -> Any:
    if name == "generate":
        from .decode import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unsupported_options(fn: Callable, options: Mapping[str, Any]) -> list[str]:
    """The names in ``options`` that ``fn`` takes no keyword argument for."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in options if name not in params or params[name].kind is params[name].POSITIONAL_ONLY]


class TransformersSampler:
    """Samples with the engine's own model through our decode loop (``engine.sample``)."""

    def __init__(self, *, engine: Any, config: Mapping[str, Any]) -> None:
        if config:
            raise InputError(f"sampler_config: the 'transformers' sampler takes no options, got {sorted(config)}")
        self.engine = engine

    def sample(self, prompts, params, num_samples, *, prompt_logprobs, topk_prompt_logprobs, **scores):
        missing = unsupported_options(self.engine.sample, scores)
        if missing:
            raise InputError(f"{missing[0]}: engine {self.engine.name!r} does not compute it, so its "
                             f"'transformers' sampler cannot serve it")
        return self.engine.sample(prompts, params, num_samples, prompt_logprobs, topk_prompt_logprobs, **scores)

    def close(self) -> None:
        self.engine = None


@hookimpl
def skyrl_sdk_register_samplers(register):
    register("transformers", TransformersSampler,
             description="Our KV-cached decode loop on the engine's own model, in-process (the default).")
