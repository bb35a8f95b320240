"""What the ``fsdp`` controller hands a sampler: its weights as a ``WeightsSource``.

The controller holds no model. Our decode loop runs on rank 0, on an unsharded copy of the
current weights gathered when the engine's weights version moved (``RankEngine.op_sample``);
the request travels as plain data (``skyrl_sdk.engines.plain``). Other samplers read
the weights as a Hugging Face directory the ranks export (LoRA merged: the ranks keep no
separate base to hand out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skyrl_sdk.engines.plain import sample_request_to_plain
from skyrl_sdk.errors import InputError
from skyrl_sdk.models import load_config
from skyrl_sdk.sampling import Decoder, SampleRequest, WeightsSource
from skyrl_sdk.types import SampleOutput


class RankZeroDecoder(Decoder):
    """Sends the request to the ranks, as plain data; rank 0 runs our decode loop and answers."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def generate(self, request: SampleRequest) -> list[SampleOutput]:
        return self._engine.dispatch_sample(sample_request_to_plain(request))


class FSDPWeights(WeightsSource):
    """The ``fsdp`` engine's weights (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        if engine.role != "policy":
            raise InputError("sampling needs a policy model; this Backend's role is 'critic'")
        self._engine = engine
        self.model_name = engine.info.model_name
        self.tokenizer = engine.tokenizer
        self.hf_config, _ = load_config(engine.info.model_name)
        self.eos_token_id = engine.info.eos_token_id
        pad = getattr(self.hf_config, "pad_token_id", None)
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0
        self.lora = engine.lora
        self.dtype = engine.config.dtype

    @property
    def version(self) -> int:
        return self._engine.weights_version

    def export_base(self, directory: Path) -> None:
        if self.lora is not None:
            raise InputError("the fsdp engine cannot hand a sampler its LoRA model's base weights apart from the "
                             "adapters; sample with sampler='transformers', or train with engine='local'")
        self._engine.export_weights(Path(directory), merge_lora=True)

    def decoder(self) -> RankZeroDecoder:
        return RankZeroDecoder(self._engine)
