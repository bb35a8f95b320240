"""The ``local`` engine: one process, one device (CPU or CUDA)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from ..errors import EngineError, InputError
from ..hooks import Register, hookimpl
from ..losses.resolve import ResolvedLoss
from ..models.activation_checkpointing import enable_activation_checkpointing
from ..models.attention import check_available
from ..models.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, dedupe_shared, save_tensors
from ..models.loading import LoadedModel, hf_model, load_model
from ..types import AdamParams, Datum, LoraConfig
from .base import Engine, EngineInfo, EngineResult, image_inputs, runner_options, scoring_model
from .config import EngineConfig
from .export import (
    export_hf_directory,
    full_state_dict,
    lora_unties_head,
    merged_lora_state_dict,
    save_peft_adapter,
)
from .pool import SOLO_ADAPTER
from .runner import ModelRunner
from .state import StateLayout, check_engine_metadata, check_state_files
from .throughput import cuda_name, peak_flops
from .trainer_offload import TrainerOffload
from .turns import Steps, run_to_end
from .weights import EngineWeights

logger = logging.getLogger(__name__)


class LocalEngine(Engine):
    """Runs a Hugging Face model on one device."""

    name = "local"

    def __init__(
        self, *, model: str, role: str, lora: LoraConfig | None, seed: int, engine_config: dict | None
    ) -> None:
        self.config = EngineConfig.from_mapping(engine_config)
        if self.config.world_size != 1:
            raise InputError("engine_config['world_size']: the local engine runs 1 rank; use engine='fsdp'")
        self.device = self.config.torch_device()
        check_available(self.config.attn_implementation, self.device.type)
        # the parameters are the master weights (float32 unless master_dtype says otherwise)
        self.loaded: LoadedModel = load_model(
            model, role=role, lora=lora, seed=seed, dtype=self.config.master_torch_dtype, device=self.device,
            train_vision_tower=self.config.train_vision_tower, attn_implementation=self.config.attn_implementation,
        )
        if self.config.gradient_checkpointing:
            enable_activation_checkpointing(self.loaded.module)
        scoring = scoring_model(self.loaded.module, role, self.config)
        self.runner = ModelRunner(scoring, **runner_options(self.config, self.loaded, self.device))
        self.info = EngineInfo.of(self.loaded)
        self.tokenizer = self.loaded.tokenizer
        self.images = image_inputs(model, self.config)
        if self.config.offload_while_sampling:
            self.trainer_offload = TrainerOffload(self.loaded.module, self.runner.optimizer, self.device)

    @property
    def prefix_sharing(self) -> str:
        return self.runner.prefix_status

    # ---- compute ----------------------------------------------------------------------
    def run(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool,
            keep_grads_on_error: bool | None = None) -> EngineResult:
        return run_to_end(self.run_steps(data, loss, backward=backward, keep_grads_on_error=keep_grads_on_error))

    def run_steps(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool,
                  keep_grads_on_error: bool | None = None) -> Steps[EngineResult]:
        return (yield from self.runner.steps(data, loss, backward=backward, keep_grads_on_error=keep_grads_on_error))

    def peak_flops(self) -> float | None:
        dev = self.device
        return peak_flops(dev.type, cuda_name(dev.type, dev.index), self.config.dtype, self.config.peak_tflops)

    # ---- colocated memory (engine_config offload_while_sampling) -----------------------
    #: the trainer's tensors' move to host memory and back; None: the option is off
    trainer_offload: TrainerOffload | None = None

    def offload_to_host(self) -> bool:
        return self.trainer_offload is not None and self.trainer_offload.to_host()

    def reload_to_device(self) -> None:
        if self.trainer_offload is not None:
            self.trainer_offload.to_device()

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        return self.runner.optimizer.step(params, grad_scale)

    def zero_grad(self) -> None:
        self.runner.zero_grad()

    # ---- state ------------------------------------------------------------------------
    def save_state(self, directory: Path) -> dict[str, Any]:
        weights, aliases = dedupe_shared(dict(self.loaded.module.state_dict()))
        save_tensors(weights, directory / WEIGHTS_FILE)
        self.runner.optimizer.save(directory / OPTIMIZER_FILE)
        return {"tied_aliases": aliases, "step": self.runner.optimizer.step_count}

    def state_layout(self) -> StateLayout:
        state = self.loaded.module.state_dict()
        _, aliases = dedupe_shared(dict(state))
        return StateLayout.of(state, self.runner.named_trainable(), aliases)

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        # Read and check everything before touching the model: a bad checkpoint changes nothing.
        step, _ = check_engine_metadata(metadata, str(directory))
        checked = check_state_files(directory, self.state_layout(), optimizer=optimizer, keep=True)
        self.loaded.module.load_state_dict(checked.weights, strict=False)
        self.runner.zero_grad()
        self.runner.optimizer.restore(checked.moments if optimizer else None, step)

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        module = self.loaded.module
        if self.loaded.lora is not None and not merge_lora:
            save_peft_adapter(module, directory)
            for files in (self.tokenizer, (self.images.processor if self.images is not None else None)):
                if files is not None:
                    files.save_pretrained(str(directory))
            return
        state = merged_lora_state_dict(module) if self.loaded.lora is not None else full_state_dict(module)
        export_hf_directory(
            hf_model(module).config, state, self.tokenizer, directory, self.config.max_shard_bytes,
            architecture=self.loaded.architecture, dtype=self.config.torch_dtype,
            untie_embeddings=self.loaded.lora is not None and lora_unties_head(module),
            image_processor=self.images.processor if self.images is not None else None,
        )

    # ---- the trained tensors in memory (the server's weight snapshots) ----------------
    def turn(self) -> AbstractContextManager:
        """Entered around a read or write of the weights: nothing here; an adapter's turn on a
        shared base (which reloads it if offloaded) for the engines there."""
        return contextlib.nullcontext()

    def copy_trainable(self, max_bytes: int) -> dict[str, torch.Tensor] | None:
        with self.turn():
            params = self.runner.named_trainable()
            if sum(p.numel() * p.element_size() for _, p in params) > max_bytes:
                return None
            return {name: p.detach().to("cpu", copy=True) for name, p in params}

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        with self.turn(), torch.no_grad():
            params = dict(self.runner.named_trainable())
            if params.keys() != tensors.keys():
                missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
                raise EngineError(f"these trained tensors do not fit engine {self.name!r}: missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}")
            for name, p in params.items():
                p.copy_(tensors[name])
        self.weights_changed()

    # ---- sampling ---------------------------------------------------------------------
    def weights_source(self) -> EngineWeights:
        module = self.loaded.module
        return EngineWeights(self, module=module, peft=module if self.loaded.lora is not None else None,
                             adapter=SOLO_ADAPTER if self.loaded.lora is not None else None)

    def close(self) -> None:
        self.runner.optimizer.release()
        self.loaded.module = None
        self.runner.scoring = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@hookimpl
def skyrl_sdk_register_engines(register: Register) -> None:
    register("local", LocalEngine, description="One process on one device (CPU or CUDA).")
