"""What the ``fsdp`` controller hands a sampler: its weights as a ``WeightsSource``.

The controller holds no model. Our decode loop runs on rank 0, on an unsharded copy of the
current weights gathered when the engine's weights version moved (``RankEngine.op_sample``;
the request travels as plain data, ``skyrl_sdk.engines.plain``). An inference engine in
another place has the weights *pushed* to it (``push_layout`` / ``push_weights``: every rank
sends the rows of its own shards, :mod:`.push`), a LoRA model's base once and its adapters
(``adapter_weights``, gathered to rank 0) after each change; ``base_weights`` (a Hugging Face
directory the ranks export, LoRA merged) is the slow path of samplers that can only read files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from skyrl_sdk.engines.plain import sample_request_to_plain
from skyrl_sdk.errors import EngineError, InputError
from skyrl_sdk.models import load_config
from skyrl_sdk.plugins.weight_push import PushLayout, PushTarget
from skyrl_sdk.sampling import AdapterWeights, Decoder, SampleRequest, WeightsSource
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
        self._layouts: dict[tuple[str, bool], PushLayout] = {}

    @property
    def version(self) -> int:
        return self._engine.weights_version

    def export_base(self, directory: Path) -> None:
        if self.lora is not None:
            raise InputError("the fsdp engine cannot hand a sampler its LoRA model's base weights apart from the "
                             "adapters; sample with sampler='transformers', or train with engine='local'")
        self._engine.export_weights(Path(directory), merge_lora=True)

    def push_layout(self, dtype: str, gathered: bool = False) -> PushLayout:
        """Each rank reports its rows (the layout never changes: kept per dtype)."""
        key = (dtype, gathered)
        if key not in self._layouts:
            per_rank = self._engine._all("push_layout", dtype=dtype, gathered=gathered)
            self._layouts[key] = PushLayout.merge(per_rank, gathered=gathered)
        return self._layouts[key]

    def push_weights(self, target: PushTarget, layout: PushLayout) -> None:
        failures = self._engine._all("push_weights", target=target.to_plain(), layout=layout.to_plain())
        failed = [f"rank {r}: {why}" for r, why in enumerate(failures) if why is not None]
        if failed:
            raise EngineError("pushing the weights failed on " + "; ".join(failed))

    def adapter_weights(self) -> AdapterWeights:
        if self.lora is None:
            return super().adapter_weights()
        config, tensors = self._engine._all("adapter_weights")[0]
        return AdapterWeights(config=config, tensors={k: torch.tensor(v) for k, v in tensors.items()})

    def decoder(self) -> RankZeroDecoder:
        return RankZeroDecoder(self._engine)
