"""What the in-process engines hand a sampler: their weights as a
:class:`~skyrl_sdk.plugins.samplers.WeightsSource`, never the engine itself.

One class serves the local engine (full fine-tuning or a solo LoRA model) and the engines
on a shared base (one adapter, or the read-only base): the engine gives the module, the peft
wrapper and adapter name when there is one, the key of its base, and its turn (a shared
base runs one adapter at a time; the local engine has no turns).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..models.loading import hf_model
from ..plugins.samplers import AdapterWeights, WeightsSource
from ..plugins.weight_push import PushLayout, PushTarget, TensorSlices, local_slice, push_slices
from ..sampling.decoder import ModuleDecoder
from .export import base_state_dict, export_hf_directory, full_state_dict


class EngineWeights(WeightsSource):
    """An in-process engine's weights, read in the engine's turn (see the module docstring).

    ``module``: the model the engine runs (peft-wrapped for LoRA); ``peft``: the peft wrapper
    holding the base and the adapters (None: no adapters); ``adapter``: this model's adapter
    name in ``peft`` (None: the base, or full fine-tuning); ``base_key``: equal for the
    adapters of one shared base, whose base weights never change.
    """

    def __init__(self, engine: Any, *, module: torch.nn.Module, peft: Any, adapter: str | None,
                 base_key: Hashable | None = None,
                 turn: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        if engine.loaded.role != "policy":
            raise InputError("sampling needs a policy model; this Backend's role is 'critic'")
        self._engine, self._module, self._peft, self._adapter = engine, module, peft, adapter
        self._base_key = self if base_key is None else base_key
        self._turn = turn
        self.model_name = engine.info.model_name
        self.tokenizer = engine.tokenizer
        self.hf_config = hf_model(module).config
        self.eos_token_id = engine.info.eos_token_id
        self.pad_token_id = engine.runner.pad_id
        self.lora = engine.loaded.lora
        self.dtype = engine.config.dtype
        self.device = engine.device
        self.in_process = True

    @property
    def version(self) -> int:
        return self._engine.weights_version

    @property
    def base_key(self) -> Hashable:
        return self._base_key

    def _base_state(self) -> dict[str, torch.Tensor]:
        return base_state_dict(self._peft) if self._peft is not None else full_state_dict(self._module)

    def export_base(self, directory: Path) -> None:
        with self._turn():
            export_hf_directory(self.hf_config, self._base_state(), self.tokenizer, Path(directory),
                                self._engine.config.max_shard_bytes, architecture=self._engine.info.architecture,
                                dtype=self._engine.config.torch_dtype)

    def base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live tensors (no copy), collected in the engine's turn."""
        with self._turn():
            return iter(list(self._base_state().items()))

    def push_state(self) -> dict[str, torch.Tensor]:
        """What :meth:`push_weights` sends, by name: the base state, tied tensors once (the first
        name: vLLM ties the others itself); the live tensors, no copy."""
        seen: set[int] = set()
        out = {}
        for name, t in self._base_state().items():
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = t
        return out

    def push_layout(self, dtype: str, gathered: bool = False) -> PushLayout:
        """One trainer rank (this process) holding every row (gathered or not)."""
        with self._turn():
            state = self.push_state()
        return PushLayout(ranks=1, gathered=gathered, tensors=tuple(
            TensorSlices(name=n, dtype=dtype if t.is_floating_point() else str(t.dtype).removeprefix("torch."),
                         shape=tuple(t.shape), rows=((0, t.shape[0] if t.dim() else 1),))
            for n, t in state.items()))

    def push_weights(self, target: PushTarget, layout: PushLayout) -> None:
        with self._turn(), torch.no_grad():
            state = self.push_state()
            push_slices(target, 0, layout, (local_slice(state[t.name], t.rows[0], t.dtype) for t in layout.tensors))

    def adapter_weights(self) -> AdapterWeights:
        if self.lora is None or self._adapter is None:
            return super().adapter_weights()
        from peft import get_peft_model_state_dict

        with self._turn(), torch.no_grad():
            state = get_peft_model_state_dict(self._peft, adapter_name=self._adapter, save_embedding_layers=False)
            tensors = {k: v.detach().clone() for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}
            config = self._peft.peft_config[self._adapter].to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        return AdapterWeights(config=config, tensors=tensors)

    def decoder(self) -> ModuleDecoder:
        return ModuleDecoder(self._engine.loaded.module, self.tokenizer, self.device, self.eos_token_id,
                             self.pad_token_id, session=self._decoding)

    @contextlib.contextmanager
    def _decoding(self) -> Iterator[int | None]:
        """The turn and the compute precision; yields prefix sharing's threshold (see ModuleDecoder)."""
        runner = self._engine.runner
        with self._turn():
            if self.dtype != "float32":  # bf16 samples are rescored, on forward's shared rows
                runner.prefix.check(self.device)
            with runner.compute_precision():  # sample in the dtype forward computes in
                yield runner.prefix.min_tokens
