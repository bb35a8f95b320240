"""The ``sharded`` state format (a ``torch.distributed.checkpoint`` folder), checked and read safely.

torch's own reader unpickles the folder's ``.metadata`` with ``pickle.load`` and non-tensor
items with ``torch.load(weights_only=False)``: a crafted folder would run code. Here the
metadata goes through an allow-list of DCP's metadata classes, non-tensor items through
``weights_only=True``, and every data file must be a plain file inside the folder.

:func:`check_sharded` runs on the controller before any rank loads: every key present,
shape and dtype equal to the live parameter or its AdamW moment, every value finite (a
second moment >= 0, a ``step`` a finite scalar >= 0), so a bad state changes nothing.
Only sharded states written by this engine are meant to be loaded: from your own storage.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from skyrl_sdk.engines.state import StateLayout, TensorSpec
from skyrl_sdk.errors import CheckpointError

#: How many problems one error message lists.
MAX_LISTED = 5
#: The value check reads at most about this many bytes at a time.
CHECK_BATCH_BYTES = 256 << 20
#: An AdamW ``step``: a float32 scalar (>= 0).
STEP_SPEC = TensorSpec((), torch.float32)
#: Globals a DCP ``.metadata`` pickle may name, besides DCP's metadata classes and torch dtypes.
_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """A :class:`FileSystemReader` that unpickles ``.metadata`` through an allow-list (once),
    and refuses data files outside the folder, links and rank-local metadata."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.folder = Path(folder)
        self._metadata: dcp_metadata.Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.folder}: rank-local metadata is not supported")
        if self._metadata is None:
            self._metadata = read_metadata(self.folder)
        assert self._metadata.storage_meta is not None  # read_metadata fills it in
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, with non-tensor items unpickled ``weights_only`` (plain data only)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raw = value.read()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)  # refuses anything but plain data
        except Exception as exc:
            raise CheckpointError(f"{read_item.dest_index.fqn}: not plain data: {exc}") from None
        super().load_bytes(read_item, io.BytesIO(raw))  # only what weights_only accepted


def read_metadata(folder: Path) -> dcp_metadata.Metadata:
    """The folder's metadata, unpickled through the allow-list; its data files checked."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"{folder.parent}: missing the sharded checkpoint folder {folder.name!r} "
                              f"(or it is a symbolic link)")
    links = sorted(p.name for p in folder.iterdir() if p.is_symlink())
    if links:
        raise CheckpointError(f"{folder}: {links[0]} is a symbolic link; a checkpoint holds regular files only")
    try:
        with open(folder / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise ValueError(f"expected DCP Metadata, got {type(metadata).__name__}")
    except Exception as exc:
        raise CheckpointError(f"{folder}: unreadable sharded checkpoint metadata: {exc}") from None
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") \
                or not (folder / name).is_file():
            raise CheckpointError(f"{folder}: metadata names a data file {name!r} that is not a file in the folder")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = dcp_metadata.StorageMeta()
    return metadata


def expected_keys(layout: StateLayout, optimizer: bool) -> dict[str, tuple[TensorSpec, bool]]:
    """DCP key -> (spec, second moment?) of every tensor a sharded load reads."""
    expected = {f"model.{k}": (spec, False) for k, spec in layout.weights.items()}
    if optimizer:
        for name, spec in layout.trainable.items():
            expected[f"optim.state.{name}.exp_avg"] = (spec, False)
            expected[f"optim.state.{name}.exp_avg_sq"] = (spec, True)
            expected[f"optim.state.{name}.step"] = (STEP_SPEC, True)
    return expected


def _raise_if_any(folder: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"{folder}: sharded state does not fit this model: "
                              + "; ".join(problems[:MAX_LISTED]) + more)


def check_sharded(folder: Path, layout: StateLayout, optimizer: bool) -> None:
    """Check a sharded state against ``layout``: structure from the metadata, then every value.

    Reads one batch of full tensors at a time (on this process, no collectives). Raises
    :class:`CheckpointError` naming the folder, the key, its data files and the problem.
    """
    folder = Path(folder)
    metadata = read_metadata(folder)
    saved = metadata.state_dict_metadata
    expected = expected_keys(layout, optimizer)
    aliases = {f"model.{k}" for k in layout.aliases}
    problems = [f"{key}: not a weight of this model" for key in saved
                if key.startswith("model.") and key not in expected and key not in aliases]
    for key, (spec, _) in expected.items():
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: missing")
        elif not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: not a tensor")
        elif tuple(meta.size) != spec.shape or meta.properties.dtype != spec.dtype:
            problems.append(f"{key}: {list(meta.size)} {meta.properties.dtype}, expected "
                            f"{list(spec.shape)} {spec.dtype}")
    _raise_if_any(folder, problems)
    files: dict[str, set[str]] = defaultdict(set)
    for index, info in (metadata.storage_data or {}).items():
        files[index.fqn].add(info.relative_path)
    reader = SafeReader(folder)
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, (spec, _)) in enumerate(expected.items()):
        batch[key] = torch.empty(spec.shape, dtype=spec.dtype)
        size += batch[key].numel() * batch[key].element_size()
        if size >= CHECK_BATCH_BYTES or i == len(expected) - 1:
            _read(reader, folder, batch)
            for k, tensor in batch.items():
                spec, second = expected[k]
                problem = spec.problem(tensor, non_negative=second)
                if problem:
                    problems.append(f"{k} (in {', '.join(sorted(files[k]))}): {problem}")
            batch, size = {}, 0
    _raise_if_any(folder, problems)


def _read(reader: SafeReader, folder: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": on purpose
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{folder}: unreadable sharded checkpoint data: {exc}") from None


def load_sharded(state: dict[str, Any], folder: Path) -> None:
    """Every rank: fill ``state`` (this rank's shards) from ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner())
