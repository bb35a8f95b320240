"""Reading a Hugging Face directory's safetensors weights tensor by tensor, or slice by slice.

safetensors maps the file and reads only the bytes asked for, so a rank that loads its own
rows of each weight never holds (or touches the pages of) the rest of the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .checkpoint import WEIGHTS_FILE, WEIGHTS_INDEX


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (``{}`` when the directory has none)."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_FILE
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the file headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def read_rows(files: dict[str, Path], name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
    """Tensor ``name`` (rows ``start:stop`` of its first dimension when given), read lazily."""
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as handle:
        if start is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[start:stop]
