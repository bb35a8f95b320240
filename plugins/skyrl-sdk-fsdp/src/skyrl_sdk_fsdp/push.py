"""Pushing a rank's weights to an inference engine (``skyrl_sdk.plugins.weight_push``): from its
shards, never a full export.

What is pushed is what an export writes without merging: the Hugging Face model's tensors by
their plain names (a LoRA model's base, its adapters left out; tied tensors once). Each rank
sends the rows of dimension 0 its FSDP2 shard holds (``Shard(0)``: ``to_local()`` is exactly
those rows); a tensor that is not sharded is sent by rank 0. With ``gathered=True`` (a
transport whose one sender must hold whole tensors, such as NCCL from rank 0) every rank takes
part in each tensor's all-gather and rank 0 sends it whole, one tensor at a time.

The LoRA adapters are small: :meth:`RankPush.adapter` gathers them to rank 0, which returns them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from skyrl_sdk.models import LoadedModel, hf_model
from skyrl_sdk.plugins.weight_push import PushLayout, PushTarget, local_slice, push_slices

from .loading import shard_rows

_BASE = ".base_layer."


def _name_of_dtype(t: torch.Tensor, wire: str) -> str:
    return wire if t.is_floating_point() else str(t.dtype).removeprefix("torch.")


class RankPush:
    """One rank's side of a push (see the module docstring)."""

    def __init__(self, loaded: LoadedModel, hf_aliases: dict[str, str], rank: int, world_size: int) -> None:
        self.loaded = loaded
        self.hf_aliases = hf_aliases
        self.rank = rank
        self.world_size = world_size

    def _items(self) -> list[tuple[str, torch.Tensor]]:
        state = hf_model(self.loaded.module).state_dict(keep_vars=True)
        return [(name.replace(_BASE, "."), t) for name, t in state.items()
                if "lora_" not in name and name not in self.hf_aliases]

    def _rows(self, t: torch.Tensor, gathered: bool) -> tuple[int, int]:
        n = t.shape[0] if t.dim() else 1
        if isinstance(t, DTensor) and t.dim() and not gathered:
            return shard_rows(t)
        return (0, n) if self.rank == 0 else (0, 0)

    def layout(self, dtype: str, gathered: bool) -> list[tuple[str, str, tuple[int, ...], tuple[int, int]]]:
        """This rank's part of the layout: ``(name, wire dtype, full shape, its rows)`` per tensor."""
        return [(name, _name_of_dtype(t, dtype), tuple(t.shape), self._rows(t, gathered))
                for name, t in self._items()]

    def _slices(self, layout: PushLayout) -> Iterator[torch.Tensor]:
        items = dict(self._items())
        for spec in layout.tensors:
            t = items[spec.name]
            rows = spec.rows[self.rank]
            if layout.gathered or not isinstance(t, DTensor):
                whole = t.full_tensor() if isinstance(t, DTensor) else t  # a collective: every rank, same order
                yield local_slice(whole, rows, spec.dtype)
            else:
                yield local_slice(t.to_local(), rows, spec.dtype, offset=rows[0])

    def send(self, target: PushTarget, layout: PushLayout) -> str | None:
        """Send this rank's rows; a transport failure is returned as text, not raised: the trainer
        is unharmed by a lost inference engine (no collective of the trainer is involved unless
        ``layout.gathered``, and then every rank took part in each gather before any send)."""
        with torch.no_grad():
            slices = self._slices(layout)
            try:
                push_slices(target, self.rank, layout, slices)
            except Exception as exc:  # reported to the controller, which names the engine
                for _ in slices:  # the other ranks' gathers (gathered layouts) still need this rank
                    pass
                return f"{type(exc).__name__}: {exc}"
        return None

    def adapter(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """The LoRA adapter on rank 0 (peft's names and config), gathered tensor by tensor."""
        from peft import get_peft_model_state_dict

        module = self.loaded.module
        sharded = module.state_dict(keep_vars=True)
        kept = get_peft_model_state_dict(module, state_dict=sharded, save_embedding_layers=False)
        tensors = {}
        for name, t in kept.items():
            if ".lora_A." not in name and ".lora_B." not in name:
                continue
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if self.rank == 0:
                tensors[name] = whole.detach().float().cpu().numpy()
        if self.rank != 0:
            return None
        config = module.peft_config["default"].to_dict()
        config["target_modules"] = sorted(config["target_modules"])
        return {k: v for k, v in config.items() if _plain(v)}, tensors


def _plain(value: Any) -> bool:
    """Whether a peft config value is plain data (sets and enums are made lists and strings)."""
    return value is None or isinstance(value, (bool, int, float, str, list, tuple, dict))
