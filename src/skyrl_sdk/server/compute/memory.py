"""The server's memory budget (``--max-memory``): what each loaded model costs, checked before
anything is loaded.

A shared base costs its weights once; its LoRA adapters are bounded by
``--max-lora-adapters`` (the rest wait on disk). A full fine-tuning client, or a sampler of
exported weights, holds a copy of its own: weights, plus gradients and two AdamW moments
when it trains (4x the weights' bytes). The estimate comes from the model's config
(parameters counted on the ``meta`` device, no weights read).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ...errors import InputError

#: bytes per weight byte of a training copy: weights, gradients, AdamW exp_avg and exp_avg_sq
TRAINING_COPIES = 4


def weight_bytes(model: str, dtype_bytes: int) -> int:
    """Bytes of ``model``'s weights at ``dtype_bytes`` per parameter (from its config, no load)."""
    import torch

    from ...models.loading import load_config
    from ...models.vlm import auto_class

    config, _ = load_config(model)
    with torch.device("meta"):
        module = auto_class(config, "policy").from_config(config)
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values()) * dtype_bytes


class MemoryBudget:
    """Tracks full copies (by owner object, dropped when it is closed) and shared bases."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def used(self, shared_bytes: int) -> int:
        return shared_bytes + sum(self._live_copies().values())

    def _live_copies(self) -> dict[Any, int]:
        with self._lock:
            return {b: n for b, n in self._copies.items() if not getattr(b, "closed", False)}

    def copies(self, with_backends: bool = False) -> list[dict[str, Any]]:
        return [{"model": getattr(b, "model_name", "?"), "lora": getattr(b, "lora", None) is not None,
                 "bytes": n, **({"backend": b} if with_backends else {})} for b, n in self._live_copies().items()]

    def check(self, what: str, needed: int, shared_bytes: int) -> None:
        """InputError (nothing loaded) when ``needed`` more bytes would exceed the budget."""
        if self.limit is None:
            return
        used = self.used(shared_bytes)
        if used + needed > self.limit:
            mib = 2**20
            raise InputError(
                f"{what} needs about {needed / mib:.0f} MiB, and {used / mib:.0f} of the server's "
                f"{self.limit / mib:.0f} MiB (--max-memory) are in use: release a model, train a LoRA adapter "
                f"on a shared base instead of a full copy, or raise --max-memory"
            )

    def add(self, owner: Any, size: int) -> None:
        with self._lock:
            self._copies[owner] = size
