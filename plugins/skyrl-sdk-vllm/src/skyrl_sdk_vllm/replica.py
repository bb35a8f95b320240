"""One vLLM engine that gets its weights pushed: where it runs (this process, a child process, a
Ray actor), it is a :class:`Replica`.

A replica runs the ``vllm`` sampler itself (:class:`~.sampler.VllmSampler`: requests, stop rules,
prefix caching, LoRA adapters from memory) over a :class:`MirrorSource`: a weights source that
holds the model's facts (config, tokenizer, LoRA config, dtype) and no weights. The weights
arrive through vLLM's weight-transfer API (:meth:`Replica.receive`: ``init_weight_transfer_engine``
once per group, then ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``),
pushed by the trainer's ranks (:mod:`.fleet`); a LoRA model's base arrives that way once and its
adapter versions as tensors (:meth:`Replica.set_adapter`), as the in-process sampler adds them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from skyrl_sdk.errors import InputError
from skyrl_sdk.sampling import AdapterWeights, SampleRequest, WeightsSource
from skyrl_sdk.types import LoraConfig, SampleOutput


def facts_of(source: WeightsSource) -> dict[str, Any]:
    """What a replica needs to know of the model, as picklable values (no weights)."""
    return {"tokenizer": source.tokenizer, "hf_config": source.hf_config, "eos_token_id": source.eos_token_id,
            "pad_token_id": source.pad_token_id, "lora": source.lora, "dtype": source.dtype,
            "model_name": source.model_name}


class MirrorSource(WeightsSource):
    """The facts of a model whose weights are pushed into the engine directly (see the module
    docstring). ``version`` moves only with the adapter: full weights are replaced in the engine
    by the push, under the sampler, which never reloads them itself."""

    def __init__(self, facts: Mapping[str, Any]) -> None:
        self.tokenizer = facts["tokenizer"]
        self.hf_config = facts["hf_config"]
        self.eos_token_id = facts["eos_token_id"]
        self.pad_token_id = facts["pad_token_id"]
        lora = facts["lora"]
        self.lora = lora if lora is None or isinstance(lora, LoraConfig) else LoraConfig(**lora)
        self.dtype = facts["dtype"]
        self.model_name = facts["model_name"]
        self._adapter: AdapterWeights | None = None
        self._version = 0

    @property
    def version(self) -> int:
        """The version of the adapter last pushed (0 before any, and for full weights)."""
        return self._version

    def set_adapter(self, version: int, adapter: AdapterWeights) -> None:
        self._adapter = adapter
        self._version = version

    def base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())  # the engine starts from dummy weights; the first push brings the real ones

    def export_base(self, directory: Path) -> None:
        raise InputError("a pushed vLLM engine has no weights to export")

    def adapter_weights(self) -> AdapterWeights:
        if self._adapter is None:
            raise InputError(f"model {self.model_name}: no adapter was pushed to this vLLM engine yet")
        return self._adapter

    def decoder(self) -> Any:
        raise InputError("a pushed vLLM engine serves the vllm sampler only")


class Replica:
    """One vLLM engine fed by pushes (see the module docstring)."""

    def __init__(self, facts: Mapping[str, Any], sampler_config: Mapping[str, Any], backend: str) -> None:
        from .sampler import VllmSampler

        config = dict(sampler_config)
        engine_args = {**dict(config.get("engine_args") or {}), "weight_transfer_config": {"backend": backend}}
        self.source = MirrorSource(facts)
        self.sampler = VllmSampler(source=self.source, config={**config, "engine_args": engine_args})
        self.weights_version: int | None = None

    def receive(self, init_info: Mapping[str, Any] | None, update_info: Mapping[str, Any],
                version: int) -> float:
        """Take one push (joining the transfer group first when ``init_info`` is given); the
        prefix cache is reset (its keys and values were the old weights'). Returns the seconds."""
        engine = self.sampler.open_engine()
        t0 = time.perf_counter()
        with engine.lock:
            engine.wake()
            llm = engine.llm
            if init_info is not None:
                llm.init_weight_transfer_engine({"init_info": dict(init_info)})
            llm.start_weight_update()
            llm.update_weights({"update_info": dict(update_info)})
            llm.finish_weight_update()
            llm.reset_prefix_cache()  # awake for the samples that follow; it sleeps before the trainer computes
        self.weights_version = version
        return time.perf_counter() - t0

    def set_adapter(self, version: int, adapter: AdapterWeights) -> None:
        """The LoRA adapter of ``version`` (its tensors, no file): the next sample registers it."""
        self.source.set_adapter(version, adapter)

    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        return self.sampler.sample(request)

    def before_training(self) -> None:
        """The trainer computes next: the engine sleeps (``sleep_level``; a no-op at 0)."""
        self.sampler.before_training()

    def describe(self) -> str:
        return self.sampler.describe()

    def where(self) -> dict[str, Any]:
        """This engine's process and host (logs, tests)."""
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except ImportError:
            host = "127.0.0.1"
        return {"pid": os.getpid(), "host": host}

    def max_model_len(self) -> int:
        return self.sampler.open_engine().max_model_len

    def close(self) -> None:
        self.sampler.close()
