"""The sampler plugin contract, and the built-in ``transformers`` sampler registered through it.

A sampler serves ``Backend.sample``. The built-in one samples in-process from the engine's
own weights: it asks the engine to run :func:`skyrl_sdk.sampling.generate` (our
transformers decode loop) on its model (the local engine directly, the FSDP engine on rank 0
after gathering the full weights). An inference-engine package (vLLM, SGLang) registers
its own sampler under another name and reads the engine's weights itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import InputError
from ..hookspecs import hookimpl
from ..types import SampleOutput, SamplingParams


class Sampler(Protocol):
    """What a sampler factory returns."""

    def sample(
        self, prompts: Sequence[np.ndarray], params: SamplingParams, num_samples: int, *,
        prompt_logprobs: bool, topk_prompt_logprobs: int,
    ) -> list[SampleOutput]:
        """One ``SampleOutput`` per prompt, ``num_samples`` sequences each."""

    def close(self) -> None:
        """Release what the sampler holds (called by ``Backend.close``)."""


class TransformersSampler:
    """Samples with the engine's own model through our decode loop (``engine.sample``)."""

    def __init__(self, *, engine: Any, config: Mapping[str, Any]) -> None:
        if config:
            raise InputError(f"sampler_config: the 'transformers' sampler takes no options, got {sorted(config)}")
        self.engine = engine

    def sample(self, prompts, params, num_samples, *, prompt_logprobs, topk_prompt_logprobs):
        return self.engine.sample(prompts, params, num_samples, prompt_logprobs, topk_prompt_logprobs)

    def close(self) -> None:
        self.engine = None


@hookimpl
def skyrl_sdk_register_samplers(register):
    register("transformers", TransformersSampler,
             description="Our KV-cached decode loop on the engine's own model, in-process (the default).")
