"""Checking a saved training state against the live model *before* anything is loaded.

Both built-in engines load the same files (``model.safetensors``, ``optimizer.safetensors``)
and call :func:`check_state_files` first: every key present, shape and dtype equal to the
live parameter (or its AdamW moment), ``step`` a finite scalar, every value finite. A bad
file raises :class:`~skyrl_sdk.errors.CheckpointError` naming the file, the key and the
problem, and the model, its optimizer and its pending gradients stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..errors import CheckpointError
from ..models.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, read_json, reject_symlinks
from .optimizer import MOMENT_KINDS

if TYPE_CHECKING:
    from safetensors import safe_open

#: How many problems one error message lists.
MAX_LISTED = 5


@attrs.frozen
class TensorSpec:
    """Shape and dtype a saved tensor must have."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def problem(self, tensor: torch.Tensor, *, non_negative: bool = False) -> str | None:
        """What makes a saved ``tensor`` unfit to fill this spec (``None``: nothing): its dtype,
        its shape, then its values (finite; with ``non_negative`` also >= 0, as a second moment)."""
        return _tensor_problem(tensor, self) or _value_problem(tensor, non_negative)


@attrs.frozen
class StateLayout:
    """What a model's saved state must hold: weights by name (tied aliases excluded) and
    the trainable parameters whose AdamW moments may be saved."""

    weights: dict[str, TensorSpec]
    trainable: dict[str, TensorSpec]
    aliases: frozenset[str] = frozenset()

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], trainable: Iterable[tuple[str, torch.Tensor]],
           aliases: Iterable[str] = ()) -> StateLayout:
        aliases = frozenset(aliases)
        return cls(
            weights={k: TensorSpec.of(v) for k, v in state.items() if k not in aliases},
            trainable={n: TensorSpec.of(p) for n, p in trainable},
            aliases=aliases,
        )

    def to_plain(self) -> dict[str, Any]:
        """Builtins only (sent between processes)."""
        def plain(specs: Mapping[str, TensorSpec]) -> dict[str, list[Any]]:
            return {k: [list(s.shape), str(s.dtype).removeprefix("torch.")] for k, s in specs.items()}

        return {"weights": plain(self.weights), "trainable": plain(self.trainable), "aliases": sorted(self.aliases)}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> StateLayout:
        def specs(d: Mapping[str, Any]) -> dict[str, TensorSpec]:
            return {k: TensorSpec(tuple(shape), getattr(torch, dtype)) for k, (shape, dtype) in d.items()}

        return cls(specs(plain["weights"]), specs(plain["trainable"]), frozenset(plain["aliases"]))


@attrs.frozen
class CheckedState:
    """The result of :func:`check_state_files`: the tensors (when kept) and each moment's step."""

    weights: dict[str, torch.Tensor] | None
    moments: dict[str, torch.Tensor] | None
    steps: dict[str, float]


class _Problems:
    def __init__(self, file: Path) -> None:
        self.file = file
        self.items: list[str] = []

    def add(self, key: str, problem: str) -> None:
        self.items.append(f"{key}: {problem}")

    def raise_if_any(self, what: str) -> None:
        if self.items:
            more = f" (and {len(self.items) - MAX_LISTED} more)" if len(self.items) > MAX_LISTED else ""
            raise CheckpointError(f"{self.file}: {what}: " + "; ".join(self.items[:MAX_LISTED]) + more)


def _value_problem(tensor: torch.Tensor, non_negative: bool = False) -> str | None:
    if not tensor.is_floating_point():
        return None
    if not bool(torch.isfinite(tensor).all()):
        return "holds non-finite values (NaN or infinity)"
    if non_negative and bool((tensor < 0).any()):
        return "holds negative values (a second moment is never negative)"
    return None


def _tensor_problem(tensor: torch.Tensor, spec: TensorSpec) -> str | None:
    if tensor.dtype != spec.dtype:
        return f"dtype {str(tensor.dtype).removeprefix('torch.')}, expected {str(spec.dtype).removeprefix('torch.')}"
    if tuple(tensor.shape) != spec.shape:
        return f"shape {list(tensor.shape)}, expected {list(spec.shape)}"
    return None


def _open(file: Path) -> safe_open:
    from safetensors import safe_open

    if file.is_symlink():
        raise CheckpointError(f"{file} is a symbolic link; a checkpoint holds regular files only")
    if not file.is_file():
        raise CheckpointError(f"missing checkpoint file {file}")
    try:
        return safe_open(str(file), "pt")
    except Exception as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None


def _read(handle: safe_open, file: Path, key: str) -> torch.Tensor:
    try:
        return handle.get_tensor(key)
    except Exception as exc:
        raise CheckpointError(f"{file}: {key}: unreadable tensor: {exc}") from None


def _check_weights(file: Path, layout: StateLayout, keep: bool) -> dict[str, torch.Tensor] | None:
    problems = _Problems(file)
    kept: dict[str, torch.Tensor] = {}
    with _open(file) as f:
        keys = list(f.keys())
        for name in layout.weights:
            if name not in keys:
                problems.add(name, "missing")
        for key in keys:
            spec = layout.weights.get(key)
            if spec is None and key not in layout.aliases:
                problems.add(key, "not a weight of this model")
                continue
            tensor = _read(f, file, key)
            if key in layout.aliases:  # a tied name: checked against nothing, loaded through its target
                continue
            assert spec is not None  # None only for an alias (skipped) or an unknown key (refused)
            problem = spec.problem(tensor)
            if problem:
                problems.add(key, problem)
            elif keep:
                kept[key] = tensor
    problems.raise_if_any("checkpoint weights do not fit this model")
    return kept if keep else None


def _check_moments(file: Path, layout: StateLayout, keep: bool
                   ) -> tuple[dict[str, torch.Tensor] | None, dict[str, float]]:
    problems = _Problems(file)
    kept: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    with _open(file) as f:
        keys = set(f.keys())
        params = set()
        for key in sorted(keys):
            name, _, kind = key.rpartition("::")
            if name not in layout.trainable or kind not in MOMENT_KINDS:
                problems.add(key, "not an AdamW state of a trainable parameter of this model")
            else:
                params.add(name)
        for name in sorted(params):
            spec = layout.trainable[name]
            for kind in MOMENT_KINDS:
                key = f"{name}::{kind}"
                if key not in keys:
                    problems.add(key, f"missing (the file holds other moments of {name})")
                    continue
                tensor = _read(f, file, key)
                if kind == "step":
                    if not tensor.is_floating_point() or tensor.numel() != 1 or tensor.dim() > 1:
                        problems.add(key, f"expected a floating scalar, got {str(tensor.dtype)} of shape "
                                          f"{list(tensor.shape)}")
                    elif not (torch.isfinite(tensor).all() and float(tensor.reshape(())) >= 0):
                        problems.add(key, f"expected a finite count >= 0, got {float(tensor.reshape(()))}")
                    else:
                        steps[name] = float(tensor.reshape(()))
                        if keep:
                            kept[key] = tensor
                    continue
                problem = spec.problem(tensor, non_negative=kind == "exp_avg_sq")
                if problem:
                    problems.add(key, problem)
                elif keep:
                    kept[key] = tensor
    problems.raise_if_any("optimizer state does not fit this model")
    return (kept if keep else None), steps


def check_state_files(directory: Path, layout: StateLayout, *, optimizer: bool, keep: bool = False) -> CheckedState:
    """Check ``directory``'s weights (and, with ``optimizer``, AdamW moments) against ``layout``.

    Reads one tensor at a time; with ``keep`` the checked tensors are returned for loading.
    Raises :class:`CheckpointError` listing the problems; changes nothing.
    """
    directory = Path(directory)
    weights = _check_weights(directory / WEIGHTS_FILE, layout, keep)
    moments: dict[str, torch.Tensor] | None = None
    steps: dict[str, float] = {}
    if optimizer:
        moments, steps = _check_moments(directory / OPTIMIZER_FILE, layout, keep)
    return CheckedState(weights=weights, moments=moments, steps=steps)


def check_engine_metadata(metadata: Any, where: str) -> tuple[int, dict[str, str]]:
    """The ``engine_state`` of ``skyrl_state.json``: returns ``(step, tied_aliases)``."""
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: engine_state: expected an object, got {type(metadata).__name__}")
    step = metadata.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: engine_state.step: expected an integer >= 0, got {step!r}")
    aliases = metadata.get("tied_aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CheckpointError(f"{where}: engine_state.tied_aliases: expected an object of names, got {aliases!r}")
    return step, aliases


#: what a Backend's state must agree on with the live model
IDENTITY_KEYS = ("architecture", "vocab_size", "num_parameters", "role", "lora")


def read_state_metadata(directory: Path, file: str, state_format: int, mine: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata ``file`` of a saved state in ``directory``, checked: a JSON object of format
    ``state_format`` whose ``identity`` matches ``mine`` (the live model's), or
    ``CheckpointError`` naming the directory and what differs."""
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint directory at {directory}")
    reject_symlinks(directory)
    meta = read_json(directory / file)
    where = str(directory / file)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != state_format:
        raise CheckpointError(f"{where}: unsupported state format {meta.get('format')!r}")
    for key in ("identity", "engine_state"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(f"{where}: {key}: expected an object, got {meta.get(key)!r}")
    theirs = meta["identity"]
    for key in IDENTITY_KEYS:
        if mine.get(key) != theirs.get(key):
            raise CheckpointError(f"{directory} holds a state of another model: {key} is {theirs.get(key)!r} there, "
                                  f"{mine.get(key)!r} here")
    return meta
