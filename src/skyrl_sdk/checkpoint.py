"""Atomic, pickle-free saves: safetensors for tensors, JSON for metadata.

Everything is written into a temporary directory beside the target, fsynced, then renamed
into place, so an interrupted save never leaves a half-written directory at the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: AdamW state of a training checkpoint: ``<param>::exp_avg``, ``::exp_avg_sq``, ``::step``.
OPTIMIZER_FILE = "optimizer.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``path`` only if the block succeeds."""
    target = Path(path).expanduser().resolve()
    if target.exists() and not overwrite:
        raise CheckpointError(f"{target} already exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def dedupe_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that alias an earlier one (tied weights); return (unique, alias->kept)."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype) \
            if tensor.device.type != "meta" else (name,)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = tensor
    return unique, aliases


def save_tensors(state: dict[str, torch.Tensor], file: Path, metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(file), metadata=metadata)


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"missing checkpoint file {file}")
    try:
        return load_file(str(file))
    except Exception as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None


def write_hf_weights(
    state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write HF-style safetensors weights, sharded with an index when above ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_tensors(shards[0], directory / WEIGHTS_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(shard, directory / fname, metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True))


def read_json(file: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"missing checkpoint file {file}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None
