"""Building a rank's model without a full copy: meta device, shard, then fill each shard.

Two sources fill the shards after :func:`~skyrl_sdk_fsdp.parallelize.parallelize`:

- ``"files"``: every rank reads only its own rows of each weight from the directory's
  safetensors files (lazily: the rest of the file is never read), plus the tensors the
  files lack (LoRA adapters, a new value head) from :attr:`LoadedModel.generated`.
- ``"rank0"``: rank 0 holds the full weights (the seeded ``tiny`` model, or a checkpoint
  whose names or shapes need transformers' own loading, e.g. fused MoE experts) and
  scatters them one tensor at a time.

Buffers (RoPE tables) are built for real on every rank and kept through materialization.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from skyrl_sdk.models import TINY_NAME, LoadedModel, hf_model, load_model
from skyrl_sdk.models.weight_files import read_rows, tensor_shapes, weight_files
from skyrl_sdk.types import LoraConfig

logger = logging.getLogger(__name__)


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """State-dict names that are the same parameter as an earlier name (tied embeddings);
    by identity, so it works on the meta device too."""
    seen: dict[int, str] = {}
    aliases = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
    return aliases


def file_name(name: str) -> str:
    """The checkpoint name of an HF-model state-dict name (peft wraps LoRA layers' weights)."""
    return name.replace(".base_layer.", ".")


def _sliceable(loaded: LoadedModel) -> str | None:
    """Why the files cannot fill this model slice by slice (``None``: they can)."""
    if loaded.weights_dir is None:
        return "generated from the seed"
    files = weight_files(loaded.weights_dir)
    if not files:
        return "no safetensors weights"
    shapes = tensor_shapes(files)
    inner = hf_model(loaded.module)
    aliases = tied_aliases(inner)
    buffers = {n for n, _ in inner.named_buffers()}
    for name, tensor in inner.state_dict(keep_vars=True).items():
        if name in aliases or name in loaded.generated or name in buffers:
            continue
        key = file_name(name)
        if key not in shapes:
            return f"{key!r} is not in the files"
        if shapes[key] != tuple(tensor.shape):
            return f"{key!r} has shape {shapes[key]} in the files, {tuple(tensor.shape)} in the model"
    return None


def load_rank_model(*, model: str, role: str, lora: LoraConfig | None, seed: int, dtype: torch.dtype,
                    rank: int, group: dist.ProcessGroup, train_vision_tower: bool = False,
                    attn_implementation: str | None = None) -> tuple[LoadedModel, str]:
    """This rank's unsharded-but-empty model and where its weights will come from."""
    loaded = load_model(model, role=role, lora=lora, seed=seed, dtype=dtype, materialize=False,
                        train_vision_tower=train_vision_tower, attn_implementation=attn_implementation)
    why = "generated from the seed" if model == TINY_NAME else _sliceable(loaded)
    ok = torch.tensor([int(why is None)], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if bool(ok.item()):
        return loaded, "files"
    if why != "generated from the seed":
        logger.info("fsdp: %s cannot be read slice by slice (%s): rank 0 loads it and scatters it", model, why)
    if rank == 0:
        loaded = load_model(model, role=role, lora=lora, seed=seed, dtype=dtype,
                            train_vision_tower=train_vision_tower, attn_implementation=attn_implementation)
    return loaded, "rank0"


def shard_rows(target: DTensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of dimension 0 this rank's shard holds (FSDP2: chunks)."""
    n = target.shape[0]
    world, rank = target.device_mesh.size(), target.device_mesh.get_local_rank()
    chunk = math.ceil(n / world) if n else 0
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    if stop - start != target.to_local().shape[0]:
        raise RuntimeError(f"unexpected FSDP shard: rows {start}:{stop} of {n}, local {tuple(target.to_local().shape)}")
    return start, stop


def materialize(loaded: LoadedModel, source: str, device: torch.device, full: dict[str, torch.Tensor],
                cpu_offload: bool = False) -> None:
    """Allocate this rank's shards of the sharded ``loaded.module`` and fill them.

    ``full`` holds rank 0's full tensors for the ``"rank0"`` source (taken before
    sharding; ``{}`` elsewhere). With ``cpu_offload`` the shards live in host memory and only
    the buffers (RoPE tables) on ``device``, where the compute runs.
    """
    module = loaded.module
    inner = hf_model(module)
    buffers = {n: b.detach().clone() for n, b in inner.named_buffers()}
    if any(p.device.type == "meta" for p in module.parameters()):
        module.to_empty(device=torch.device("cpu") if cpu_offload else device)
    aliases = tied_aliases(inner)
    files: dict[str, Path] = {}
    if source == "files":
        assert loaded.weights_dir is not None  # "files" only when every rank's _sliceable found its directory
        files = weight_files(loaded.weights_dir)
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, attr = name.rpartition(".")
            setattr(inner.get_submodule(owner) if owner else inner, attr, value.to(device))
        for name, target in inner.state_dict(keep_vars=True).items():
            if name in aliases or name in buffers:
                continue
            if source == "rank0":
                _scatter_from_rank0(target, full.get(name), device)
                continue
            local = target.to_local() if isinstance(target, DTensor) else target
            start, stop = shard_rows(target) if isinstance(target, DTensor) and target.dim() else (None, None)
            if name in loaded.generated:
                value = loaded.generated[name]
                value = value[start:stop] if start is not None else value
            else:
                value = read_rows(files, file_name(name), start, stop)
            local.copy_(value.to(dtype=local.dtype))
    loaded.generated = {}
    loaded.materialized = True


def _scatter_from_rank0(target: torch.Tensor, value: torch.Tensor | None, device: torch.device) -> None:
    """Rank 0's full ``value`` -> every rank's shard of ``target`` (one tensor in flight)."""
    local = target.to_local() if isinstance(target, DTensor) else target
    shape = tuple(target.shape)
    full = value.to(device=device, dtype=local.dtype) if value is not None else \
        torch.empty(shape, dtype=local.dtype, device=device)
    if isinstance(target, DTensor):
        local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0).to_local())
    else:
        dist.broadcast(full, src=0)
        local.copy_(full)
