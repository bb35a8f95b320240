"""Vision-language families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): what differs from a causal LM.

- Built with ``AutoModelForImageTextToText`` (policy) or ``AutoModel`` (critic backbone); the
  language model's sizes are in the config's ``text_config``.
- The vision tower (``visual``) is frozen by default: no LoRA adapter goes into it and full
  fine-tuning leaves its weights alone (``engine_config train_vision_tower=true`` trains it).
- Positions are M-RoPE: three rows (time, height, width) that advance by one per text token
  and, over an image, follow its grid of merged patches (:func:`mrope_positions`, the rule of
  the families' ``get_rope_index``, computed per datum so that any batching gives the same
  positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError
from ..types import ModelInput, PreparedImageChunk

#: model_type -> family name, for the families whose forward, positions and processor are checked
#: against transformers (tests/test_vlm.py).
SUPPORTED_MODEL_TYPES = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}
#: The attribute the families keep their vision tower under.
VISION_TOWER = "visual"


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def is_vision_language(config: Any) -> bool:
    """A supported vision-language config (a transformers config or its config.json as a dict)."""
    return _get(config, "model_type") in SUPPORTED_MODEL_TYPES


def check_supported(config: Any, name: str) -> None:
    """Refuse, by name, a vision-language family other than the supported ones (it would load
    as a text model or not at all)."""
    if _get(config, "vision_config") is not None and not is_vision_language(config):
        raise ModelLoadError(
            f"model {name!r}: {_get(config, 'model_type')!r} is a vision-language model skyrl-sdk does not "
            f"support; supported: {', '.join(SUPPORTED_MODEL_TYPES.values())}"
        )


def text_config(config: Any) -> Any:
    """The language model's config (the config itself for a text-only model)."""
    if isinstance(config, dict):
        return config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def auto_class(config: Any, role: str) -> Any:
    """The transformers auto class that builds ``role``'s module for ``config``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    if role != "policy":
        return AutoModel
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def vision_tower_prefixes(model: torch.nn.Module) -> list[str]:
    """Module-name prefixes (``...visual.``) of the vision towers inside ``model``."""
    return [f"{name}." for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == VISION_TOWER]


def in_vision_tower(name: str, prefixes: Sequence[str]) -> bool:
    return any(name.startswith(p) for p in prefixes)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop the vision tower's weights from training; returns how many tensors were frozen."""
    prefixes = vision_tower_prefixes(model)
    frozen = 0
    for name, p in model.named_parameters():
        if in_vision_tower(name, prefixes):
            p.requires_grad_(False)
            frozen += 1
    return frozen


def mrope_positions(model_input: ModelInput) -> np.ndarray:
    """(3, length) M-RoPE positions of one sequence: a text token advances all three rows by
    one; an image's merged patches take time = start, height = start + row, width = start +
    column, and the next position is start + max(rows, columns)."""
    rows, start = [], 0
    for chunk in model_input.chunks:
        if isinstance(chunk, PreparedImageChunk):
            t, h, w = chunk.grid_thw
            gh, gw = h // chunk.merge_size, w // chunk.merge_size
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")).reshape(3, -1)
            rows.append(grid + start)
            start += max(gh, gw)
        else:
            n = chunk.length
            rows.append(np.broadcast_to(np.arange(start, start + n), (3, n)))
            start += n
    return np.concatenate(rows, axis=1).astype(np.int64) if rows else np.zeros((3, 0), dtype=np.int64)


def image_tensors(inputs: Sequence[ModelInput]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``pixel_values`` and ``image_grid_thw`` of these sequences' images, in the order their
    positions come in the rows (None: no image)."""
    images = [c for mi in inputs for c in mi.chunks if isinstance(c, PreparedImageChunk)]
    if not images:
        return None
    pixels = torch.from_numpy(np.concatenate([c.pixel_values for c in images]))
    grids = torch.tensor([list(c.grid_thw) for c in images], dtype=torch.long)
    return pixels, grids


def padded_rows_inputs(inputs: Sequence[ModelInput], width: int, *, left_padded: bool) -> dict[str, torch.Tensor]:
    """The backbone's vision keywords for rows of ``width`` holding ``inputs`` (padded on the left
    or the right): (3, rows, width) M-RoPE ``position_ids`` (padding at 0) and the images'
    ``pixel_values`` / ``image_grid_thw`` when there are any."""
    positions = np.zeros((3, len(inputs), width), dtype=np.int64)
    for row, model_input in enumerate(inputs):
        rope = mrope_positions(model_input)
        n = rope.shape[1]
        if left_padded:
            positions[:, row, width - n:] = rope
        else:
            positions[:, row, :n] = rope
    out = {"position_ids": torch.from_numpy(positions)}
    images = image_tensors(inputs)
    if images is not None:
        out["pixel_values"], out["image_grid_thw"] = images
    return out


def as_model_input(prompt: ModelInput | np.ndarray) -> ModelInput:
    """A prompt as a ``ModelInput`` (token ids become one text chunk)."""
    return prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
