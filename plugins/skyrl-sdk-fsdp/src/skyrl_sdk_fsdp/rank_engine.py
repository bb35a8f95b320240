"""One fsdp engine on one rank: its model shard, optimizer shard and one method per call.

The controller's requests reach :meth:`RankEngine.op_<op>` through the dispatcher, on every
rank in lockstep (SPMD). Payloads and results are plain Python / numpy data: no torch
tensors cross processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import attrs
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_sdk import errors, get_registry
from skyrl_sdk.engines import EngineConfig, EngineInfo, image_inputs, runner_options, scoring_model
from skyrl_sdk.engines.plain import datums_from_plain, loss_from_plain, sample_request_from_plain
from skyrl_sdk.engines.state import StateLayout
from skyrl_sdk.models import hf_model
from skyrl_sdk.models.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, load_tensors
from skyrl_sdk.models.vlm import auto_class
from skyrl_sdk.sampling import generate
from skyrl_sdk.types import AdamParams, LoraConfig, SampleOutput

from .gather import StreamingGather, gathered
from .loading import load_rank_model, materialize, tied_aliases
from .options import FSDP_KEYS, SHARDED_DIR, FSDPOptions
from .parallelize import ShardedScoringModel, parallelize
from .push import RankPush
from .session import DistSession
from .sharded_runner import ShardedRunner

logger = logging.getLogger(__name__)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class RankEngine:
    """One engine's model shard, optimizer shard and call handlers on one rank."""

    def __init__(self, session: DistSession, *, model: str, role: str, lora: dict | None, seed: int,
                 engine_config: dict) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.session = session
        self.rank = session.rank
        self.config = EngineConfig.from_mapping(engine_config, extra_keys=FSDP_KEYS)
        self.options = FSDPOptions.from_extra(self.config.extra)
        device_type = self.config.torch_device().type  # "cpu" or "cuda" (checked by the controller)
        if device_type == "cuda" and session.device_type != "cuda":
            raise errors.InputError("engine_config['device']: CUDA ranks need a process group started with CUDA")
        self.device = torch.device("cuda", session.local_rank) if device_type == "cuda" else torch.device("cpu")
        lora_cfg = LoraConfig(**lora) if lora is not None else None
        self.mesh = init_device_mesh(self.device.type, (session.world_size,))
        # meta device on every rank (rank 0 alone builds the full model when the weights
        # cannot be read slice by slice): no rank holds a full copy while sharding
        # the sharded parameters are the masters (float32 unless master_dtype says otherwise)
        self.loaded, source = load_rank_model(model=model, role=role, lora=lora_cfg, seed=seed,
                                              dtype=self.config.master_torch_dtype, rank=self.rank,
                                              group=self.mesh.get_group(),
                                              train_vision_tower=self.config.train_vision_tower,
                                              attn_implementation=self.config.attn_implementation)
        #: a vision-language model's image processor: exports carry it
        self.images = image_inputs(model, self.config)
        module = self.loaded.module
        info = EngineInfo.of(self.loaded)  # counted before sharding: full sizes
        # names that alias an earlier tensor (tied embeddings), found before sharding
        self.aliases = tied_aliases(module)
        self.hf_aliases = tied_aliases(hf_model(module))
        # what a saved state must hold (full shapes: taken before sharding)
        trainable_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.state_layout = StateLayout.of(module.state_dict(), trainable_params, self.aliases)
        full = dict(hf_model(module).state_dict()) if source == "rank0" and self.rank == 0 else {}
        scoring = cast(ShardedScoringModel, scoring_model(module, role, self.config, cls=ShardedScoringModel))
        loss_scale = parallelize(
            scoring, self.mesh, reshard_after_forward=self.options.reshard_after_forward,
            compute_dtype=self.config.torch_dtype if self.config.mixed_precision else None,
            gradient_checkpointing=self.config.gradient_checkpointing, cpu_offload=self.options.cpu_offload,
        )
        materialize(self.loaded, source, self.device, full, cpu_offload=self.options.cpu_offload)
        del full
        self.weights_loaded_from = source
        # FSDP2's mixed precision casts the gathered parameters: no autocast on the ranks. A
        # failure mid-call stops the engine (the ranks may be out of step in their collectives),
        # so keeping pending gradients apart during a call would cost a gradient buffer for nothing.
        options = {**runner_options(self.config, self.loaded, self.device), "autocast_dtype": None,
                   "keep_grads_on_error": False}
        self.runner = ShardedRunner(scoring, group=self.mesh.get_group(), loss_scale=float(loss_scale), **options)
        self.engine_info = attrs.asdict(attrs.evolve(info, prefix_sharing=self.runner.prefix_status))
        self.gather = StreamingGather(self.loaded, self.runner, self.aliases, self.hf_aliases, self.rank)
        self.push = RankPush(self.loaded, self.hf_aliases, self.rank, session.world_size)
        #: rank 0's unsharded copy of the weights, and the controller's weights version it holds
        self._sampler: tuple[int, Any] | None = None
        self.in_collectives = False

    def info(self) -> dict:
        return dict(
            engine_info=self.engine_info,
            state_layout=self.state_layout.to_plain(),
            aliases=self.aliases,
            weights_loaded_from=self.weights_loaded_from,
            world_size=self.session.world_size,
            device=str(self.device),
            pid=os.getpid(),
        )

    def _collectives(self) -> None:
        """Mark that this call has reached its first collective (errors after it are fatal)."""
        self.in_collectives = True

    # ---- compute ----------------------------------------------------------------------
    def op_run(self, items: list, loss: dict,
               backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, tuple[float, float]], str]:
        resolved = loss_from_plain(loss, get_registry().losses, where=f"rank {self.rank}")
        data = datums_from_plain(items)
        self._collectives()
        result = self.runner.run(data, resolved, backward=backward)
        return result.outputs, result.metric_state, self.runner.prefix_status

    def op_optim_step(self, params: dict, grad_scale: float) -> dict[str, float]:
        self._collectives()
        return self.runner.optimizer.step(AdamParams(**params), grad_scale)

    def op_zero_grad(self) -> None:
        self.runner.zero_grad()

    # ---- state ------------------------------------------------------------------------
    def op_save_state(self, directory: str | Path, state_format: str) -> dict[str, Any]:
        self._collectives()
        directory = Path(directory)
        meta = {"tied_aliases": self.aliases, "step": self.runner.optimizer.step_count, "state_format": state_format}
        if state_format == "sharded":
            self._save_sharded(directory)
            meta["world_size"] = self.session.world_size
            return meta
        self.gather.save_weights(directory / WEIGHTS_FILE)
        self.gather.save_optimizer(directory / OPTIMIZER_FILE)
        return meta

    def _load_full_weights(self, file: Path) -> None:
        """A saved weights file -> every rank's shards: rank 0 reads one tensor at a time and
        scatters it (the other ranks need not see the file)."""
        from safetensors import safe_open

        module = self.loaded.module
        handle = safe_open(str(file), framework="pt") if self.rank == 0 else None
        with torch.no_grad():
            for name, target in module.state_dict(keep_vars=True).items():
                if name in self.aliases:
                    continue
                full = handle.get_tensor(name) if handle is not None else torch.empty(target.shape, dtype=target.dtype)
                full = full.to(device=self.device, dtype=target.dtype)
                if isinstance(target, DTensor):
                    shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
                    target.to_local().copy_(shard.to_local())
                else:
                    dist.broadcast(full, src=0, group=self.mesh.get_group())
                    target.copy_(full)
                del full

    def op_load_state(self, directory: str | Path, optimizer: bool, step: int, state_format: str,
                      optimizer_steps: dict[str, float]) -> None:
        directory = Path(directory)
        self._collectives()
        if state_format == "sharded":
            self._load_sharded(directory, optimizer)
        else:
            self._load_full_weights(directory / WEIGHTS_FILE)
            if optimizer:
                # rank 0 reads the moments (trainable only); the others take shapes only and
                # receive the values scattered from rank 0
                tensors = (load_tensors(directory / OPTIMIZER_FILE) if self.rank == 0
                           else self.runner.optimizer.empty_state(optimizer_steps))

                def from_full(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
                    full = full.to(device=like.device, dtype=like.dtype)
                    like = cast(DTensor, like)  # FSDP2: every parameter (so each moment) is a DTensor
                    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=0)

                self.runner.optimizer.load_state_tensors(tensors, from_full=from_full)
        self.runner.zero_grad()
        if optimizer:
            self.runner.optimizer.state_replaced(step)
        else:
            self.runner.optimizer.reset()

    def _save_sharded(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.loaded.module, self.runner.optimizer.create())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / SHARDED_DIR))

    def _load_sharded(self, directory: Path, optimizer: bool) -> None:
        # The controller checked every value first (sharded_state.check_sharded). Only the
        # tensors are read: the optimizer's param_groups stay this engine's own.
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

        from .sharded_state import load_sharded

        opt = self.runner.optimizer.create()
        model_sd, optim_sd = get_state_dict(self.loaded.module, opt)
        state: dict[str, Any] = (
            {"model": model_sd, "optim": {"state": optim_sd["state"]}} if optimizer else {"model": model_sd})
        load_sharded(state, directory / SHARDED_DIR)
        if optimizer:
            set_state_dict(self.loaded.module, opt, model_state_dict=state["model"], optim_state_dict=optim_sd)
        else:
            set_model_state_dict(self.loaded.module, state["model"])

    # ---- export / sampling ------------------------------------------------------------
    def op_export_weights(self, directory: str | Path, merge_lora: bool) -> None:
        self._collectives()
        directory = Path(directory)
        if self.loaded.lora is not None and not merge_lora:
            self.gather.save_adapter(directory, image_processor=self.images and self.images.processor)
            return None
        self.gather.export_hf(directory, self.loaded.tokenizer, self.config.max_shard_bytes,
                              image_processor=self.images and self.images.processor,
                              dtype=self.config.torch_dtype)
        return None

    def _sampler_model(self, weights_version: int) -> torch.nn.Module | None:
        """Rank 0's unsharded copy of the weights at the controller's ``weights_version`` (the
        engine's one count of weight changes: gathered again when it moved)."""
        if self._sampler is not None and self._sampler[0] == weights_version:
            return self._sampler[1]
        self._sampler = None
        tmp = Path(tempfile.mkdtemp(prefix="skyrl-fsdp-sampler-")) if self.rank == 0 else None
        try:
            self.gather.export_hf(tmp, None, self.config.max_shard_bytes,  # collective: every rank
                                  dtype=self.config.torch_dtype)
            if self.rank != 0:
                return None
            config = hf_model(self.loaded.module).config
            model = auto_class(config, "policy").from_pretrained(str(tmp), dtype=self.config.torch_dtype)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        model.to(self.device).eval()
        self._sampler = (weights_version, model)
        return model

    def op_sample(self, request: dict, weights_version: int) -> list[SampleOutput] | None:
        self._collectives()
        model = self._sampler_model(weights_version)
        if self.rank != 0:
            return None
        assert model is not None  # rank 0 always builds it (the other ranks returned above)
        return generate(model, self.loaded.tokenizer, sample_request_from_plain(request), device=self.device,
                        eos_token_id=self.engine_info["eos_token_id"], pad_token_id=self.runner.pad_id)

    # ---- pushing the weights to an inference engine (push.py) ------------------------
    def op_push_layout(self, dtype: str,
                       gathered: bool) -> list[tuple[str, str, tuple[int, ...], tuple[int, int]]]:
        return self.push.layout(dtype, gathered)

    def op_push_weights(self, target: dict, layout: dict) -> str | None:
        from skyrl_sdk.plugins.weight_push import PushLayout, PushTarget

        plan = PushLayout.from_plain(layout)
        if plan.gathered:
            self._collectives()
        return self.push.send(PushTarget.from_plain(target), plan)

    def op_adapter_weights(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        self._collectives()
        return self.push.adapter()

    # ---- introspection ----------------------------------------------------------------
    def op_gradients(self) -> dict[str, np.ndarray] | None:
        """Full gradients by parameter name (numpy, on rank 0): for tests and debugging."""
        self._collectives()
        out = {}
        for name, p in self.runner.named_trainable():
            if p.grad is not None:
                full = gathered(p.grad, self.rank)
                if self.rank == 0:
                    assert full is not None  # gathered returns the full tensor on rank 0
                    out[name] = full.float().numpy()
        return out if self.rank == 0 else None

    def op_memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameter shards, gradient shards, optimizer-state shards."""
        params = grads = 0
        seen = set()
        for p in self.loaded.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += _local_bytes(p)
            if p.grad is not None:
                grads += _local_bytes(p.grad)
        return {"rank": self.rank, "param_bytes": params, "grad_bytes": grads,
                "optimizer_bytes": self.runner.optimizer.state_bytes()}

    def op_debug_fail(self, rank: int, mode: str) -> None:
        """Tests: make ``rank`` fail ("raise" or "exit") while the others wait in a collective."""
        self._collectives()
        if self.rank == rank:
            if mode == "exit":
                os._exit(3)
            raise RuntimeError(f"injected failure on rank {rank}")
        dist.barrier(group=self.mesh.get_group())

    def close(self) -> None:
        self._sampler = None
        self.runner.optimizer.release()
        self.runner.scoring = None
        del self.loaded  # drop the model (the dispatcher drops this engine next)
