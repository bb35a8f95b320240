"""Generation from the current weights: the sampler contract and our own KV-cached decode loop.

The contract (:mod:`skyrl_sdk.plugins.samplers`, re-exported here): a :class:`Sampler` gets a
:class:`WeightsSource` (the model's facts, its weights, a version that moves when they change,
and a :class:`Decoder` where they live) and a :class:`SampleRequest` per call
(:mod:`skyrl_sdk.types.sample_request`, re-exported here too); docs/engines.md, Samplers, has
it in full.

Returned logprobs are those of the sampled tokens under the model's own distribution
(temperature 1, no top-k / top-p), i.e. what ``forward`` reports for the same tokens, so
they can be fed back as the ``logprobs`` input of RL losses. Stop rules follow Tinker
(``stops``); draws use a per-request ``torch.Generator`` (``draw``); prompt logprobs and the
rescoring of low-precision samples are in ``scores``. This module registers the built-in
``transformers`` sampler; ``generate`` loads lazily, so plugin loading stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InputError
from ..hooks import Register, hookimpl
from ..plugins.samplers import AdapterWeights, Sampler, WeightsSource
from ..types import SampleOutput, SampleRequest
from .decoder import Decoder, ModuleDecoder

__all__ = ["AdapterWeights", "Decoder", "ModuleDecoder", "SampleRequest", "Sampler", "TransformersSampler",
           "WeightsSource", "generate"]


def __getattr__(name: str) -> Any:
    if name == "generate":
        from .decode import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TransformersSampler(Sampler):
    """Our decode loop on the weights where they live (the source's :class:`Decoder`): the
    trainer's own module, in its own process, so it always samples the current weights."""

    name = "transformers"

    def __init__(self, *, source: WeightsSource, config: Mapping[str, Any]) -> None:
        if config:
            raise InputError(f"sampler_config: the 'transformers' sampler takes no options, got {sorted(config)}")
        super().__init__(source=source, config=config)

    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        return self.source.decoder().generate(request)


@hookimpl
def skyrl_sdk_register_samplers(register: Register) -> None:
    register("transformers", TransformersSampler,
             description="Our KV-cached decode loop on the engine's own model, in-process (the default).")
