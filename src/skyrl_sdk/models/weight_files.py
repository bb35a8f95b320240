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


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file, from its header and size alone (no tensor read):
    missing, not safetensors, or shorter than its header says (a truncated copy); else None."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{file.name} is truncated ({size} bytes)"
            length = int.from_bytes(head, "little")
            if length > min(size - 8, 100 * 2**20):
                return f"{file.name} is truncated or not safetensors (a {length}-byte header in {size} bytes)"
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return f"{file.name} is missing"
    except OSError as exc:
        return f"{file.name} cannot be read: {(exc.strerror or str(exc)).lower()}"
    except (ValueError, UnicodeDecodeError):
        return f"{file.name} is not safetensors (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{file.name} is not safetensors (its header is not an object)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    need = 8 + length + max(ends, default=0)
    if size < need:
        return f"{file.name} is truncated ({size} of its {need} bytes)"
    return None


def weights_problem(directory: Path) -> str | None:
    """What is wrong with a directory's safetensors weights (every file its index names, or each
    ``*.safetensors``), read from headers and sizes only; None when they look whole."""
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{WEIGHTS_INDEX} is not a safetensors index"
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return "it holds no safetensors weights"
    return next((p for p in map(safetensors_problem, files) if p is not None), None)
