"""Saves and exports of a sharded model that never hold the whole model on one rank.

Each tensor is gathered **to rank 0 only** (:func:`gathered`: every rank sends its shard, in
the same order; the other ranks never hold the full tensor nor copy it to host memory), written
by rank 0 into a safetensors file whose header was planned from the shapes up front, and dropped
before the next one. LoRA layers are merged one layer at a time, on rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from skyrl_sdk.engines.export import (
    TensorPlan,
    lora_unties_head,
    merge_lora_delta,
    write_hf_config,
    write_hf_weights_stream,
    write_tensor_stream,
)
from skyrl_sdk.models import LoadedModel, hf_model

from .sharded_runner import ShardedRunner

_BASE = ".base_layer."


def gathered(t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The full value of ``t`` in rank 0's host memory; None on the other ranks. Every rank must
    call it for the same tensors in the same order (it is a collective for a sharded tensor).

    FSDP2 shards dimension 0 in ``torch.chunk`` pieces (rank r holds rows from ``r * ceil(n /
    world)``): each rank pads its piece to that size and ``dist.gather`` brings them to rank 0,
    which cuts the padding off. A shard kept in host memory (``cpu_offload``) is sent from the
    device the process group runs on. Other layouts fall back to ``full_tensor`` (an all-gather)."""
    if not isinstance(t, DTensor):
        return t.detach().cpu() if rank == 0 else None
    mesh = t.device_mesh
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        full = t.full_tensor().detach()
        return full.cpu() if rank == 0 else None
    world, rows = mesh.size(), t.shape[0]
    chunk = math.ceil(rows / world) if rows else 0
    local = t.to_local().detach()
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    padded = torch.zeros((chunk, *t.shape[1:]), dtype=local.dtype, device=device)
    padded[:local.shape[0]].copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, pieces, group=mesh.get_group(), group_dst=0)
    if rank != 0:
        return None
    assert pieces is not None  # rank 0 built the receive list above
    return torch.cat(pieces)[:rows].cpu()


def _plan(items: Sequence[tuple[str, torch.Tensor]]) -> list[TensorPlan]:
    return [(name, tuple(t.shape), t.dtype) for name, t in items]


class StreamingGather:
    """Rank 0 writes; every rank runs the same gathers (see module docstring)."""

    def __init__(self, loaded: LoadedModel, runner: ShardedRunner, aliases: dict[str, str],
                 hf_aliases: dict[str, str], rank: int) -> None:
        self.loaded = loaded
        self.runner = runner
        self.aliases = aliases
        self.hf_aliases = hf_aliases
        self.rank = rank

    def _drain(self, tensors: Iterator[torch.Tensor | None]) -> None:
        for _ in tensors:  # ranks != 0: take part in each gather, keep nothing
            pass

    # ---- training state ("full" format) -------------------------------------------------
    def save_weights(self, file: Path) -> None:
        items = [(n, t) for n, t in self.loaded.module.state_dict(keep_vars=True).items() if n not in self.aliases]
        tensors = (gathered(t, self.rank) for _, t in items)
        if self.rank == 0:
            write_tensor_stream(file, _plan(items), cast(Iterator[torch.Tensor], tensors))  # rank 0: no None
        else:
            self._drain(tensors)

    def save_optimizer(self, file: Path) -> None:
        """AdamW moments as ``<param>::exp_avg`` / ``::exp_avg_sq`` / ``::step`` (the local engine's names)."""
        items = self.runner.optimizer.state_items()
        tensors = (gathered(t, self.rank) for _, t in items)
        if self.rank == 0:
            write_tensor_stream(file, _plan(items), cast(Iterator[torch.Tensor], tensors))  # rank 0: no None
        else:
            self._drain(tensors)

    # ---- exports ------------------------------------------------------------------------
    def _lora_layers(self) -> dict:
        if self.loaded.lora is None:
            return {}
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in hf_model(self.loaded.module).named_modules() if isinstance(m, LoraLayer)}

    def _merged_items(self) -> list[tuple[str, torch.Tensor, str | None]]:
        """(export name, source tensor, LoRA layer name or None) of the HF model's weights."""
        state = hf_model(self.loaded.module).state_dict(keep_vars=True)
        layers = self._lora_layers()
        items = []
        for name, t in state.items():
            adapted = _BASE in name and name.endswith(_BASE + "weight") and name.split(_BASE)[0] in layers
            # a tied alias is written once, except a LoRA-adapted head (its merged weight is its own)
            if "lora_" in name or (name in self.hf_aliases and not adapted):
                continue
            if _BASE in name:
                prefix = name.split(_BASE)[0]
                out = name.replace(_BASE, ".")
                items.append((out, t, prefix if name.endswith(_BASE + "weight") and prefix in layers else None))
            else:
                items.append((name, t, None))
        return items

    def _merged_tensors(self, items: list[tuple[str, torch.Tensor, str | None]]) -> Iterator[torch.Tensor | None]:
        """Each merged weight on rank 0; None on the other ranks (see :func:`gathered`)."""
        state = hf_model(self.loaded.module).state_dict(keep_vars=True)
        layers = self._lora_layers()
        for _, t, layer_name in items:
            weight = gathered(t, self.rank)
            if layer_name is not None:
                layer = layers[layer_name]
                adapters = layer.active_adapters
                lora_a = {a: gathered(state[f"{layer_name}.lora_A.{a}.weight"], self.rank) for a in adapters}
                lora_b = {a: gathered(state[f"{layer_name}.lora_B.{a}.weight"], self.rank) for a in adapters}
                if self.rank == 0:
                    assert weight is not None  # gathered returns the full tensor on rank 0
                    weight = merge_lora_delta(layer, weight, lora_a, lora_b)
            yield weight

    def export_hf(self, directory: Path | None, tokenizer: Any, max_shard_bytes: int,
                  dtype: torch.dtype | None = None, image_processor: Any = None) -> None:
        """An HF directory (LoRA merged) written by rank 0, one gathered tensor at a time;
        ``dtype`` (the compute dtype of a mixed-precision run) casts the floating tensors; a
        vision-language model's ``image_processor`` is saved beside the tokenizer."""
        items = self._merged_items()
        gathering = self._merged_tensors(items)
        if self.rank != 0:
            self._drain(gathering)
            return
        assert directory is not None  # rank 0 always writes to a directory (the others pass None)
        tensors = cast(Iterator[torch.Tensor], gathering)  # rank 0: every item is a tensor

        def cast_dtype(t: torch.dtype) -> torch.dtype:
            return dtype if dtype is not None and t.is_floating_point else t

        plan = [(name, tuple(t.shape), cast_dtype(t.dtype)) for name, t, _ in items]
        if dtype is not None:
            tensors = (t.to(dtype) if t.is_floating_point() else t for t in tensors)
        dtypes = {d for _, _, d in plan if d.is_floating_point}
        write_hf_config(hf_model(self.loaded.module).config, tokenizer, directory,
                        next(iter(dtypes)) if len(dtypes) == 1 else None, self.loaded.architecture,
                        untie_embeddings=self.loaded.lora is not None and lora_unties_head(self.loaded.module))
        write_hf_weights_stream(directory, plan, tensors, max_shard_bytes)
        if image_processor is not None:
            image_processor.save_pretrained(str(directory))

    def save_adapter(self, directory: Path, image_processor: Any = None) -> None:
        """peft's adapter directory: only what peft saves is gathered (the adapters, and the
        output embedding when LoRA trains it), never the whole base model."""
        from peft import get_peft_model_state_dict

        module = self.loaded.module
        sharded = module.state_dict(keep_vars=True)
        kept = get_peft_model_state_dict(module, state_dict=sharded)  # peft picks the names
        wanted = {id(t) for t in kept.values()}
        state = {n: gathered(t, self.rank) for n, t in sharded.items() if id(t) in wanted}
        if self.rank == 0:
            module.save_pretrained(str(directory), state_dict=state)
            for files in (self.loaded.tokenizer, image_processor):
                if files is not None:
                    files.save_pretrained(str(directory))
