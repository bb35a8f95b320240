"""In-memory weight snapshots for ``save_weights_and_get_sampling_client`` sessions.

A snapshot session pins the version of the live model it was made from. Before that model's
weights change, the tensors a sampler needs to reproduce the pinned version are copied to
CPU memory: for a LoRA model only its adapter tensors (the base is shared and never
trained), for full fine-tuning the full weights. A sampler for the snapshot is then a fresh
Backend (an adapter on the shared base, or a copy of its own) with those tensors copied in:
no disk round trip. Cookbook RL loops make one of these per step, so they are bounded: an
LRU over all models with a byte budget (``--snapshot-memory``). A snapshot evicted by the
budget fails its sessions with a clear error rather than spilling to disk, since spilling
would bring back the per-step disk writes this exists to remove; a single snapshot larger
than the whole budget (full fine-tuning of a big model) is written to disk as before.

Only the ``Engine`` contract is used: ``copy_trainable`` / ``load_trainable`` (an engine
without them is snapshotted on disk) and the engine's ``weights_version``, which pins them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import attrs
import torch

from ...errors import InputError


@attrs.define(eq=False)
class WeightsSnapshot:
    """The sampler-relevant tensors of one model at one version (None once evicted)."""

    model_id: str
    version: int
    nbytes: int
    tensors: dict[str, torch.Tensor] | None

    @property
    def key(self) -> tuple[str, int]:
        return (self.model_id, self.version)


def take_snapshot(model_id: str, backend: Any, max_bytes: int) -> WeightsSnapshot | None:
    """The trained tensors of ``backend``'s engine at its current weights version, copied to CPU
    memory (``Engine.copy_trainable``), or None when they would exceed ``max_bytes`` or its engine
    keeps no copies in memory (nothing is copied then: the caller snapshots on disk)."""
    tensors = backend.engine.copy_trainable(max_bytes)
    if tensors is None:
        return None
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return WeightsSnapshot(model_id, backend.weights_version, nbytes, tensors)


def load_snapshot(backend: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a snapshot's tensors into a sampler Backend built like the snapshotted one
    (``Engine.load_trainable``: its weights version moves, so its sampler reloads them)."""
    backend.engine.load_trainable(tensors)


class SnapshotCache:
    """All models' in-memory snapshots, least recently used first, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._snaps: collections.OrderedDict[tuple[str, int], WeightsSnapshot] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def add(self, snap: WeightsSnapshot) -> list[WeightsSnapshot]:
        """Keep ``snap`` (the most recently used); evict the least recently used beyond the budget."""
        evicted = []
        with self._lock:
            self._snaps[snap.key] = snap
            while self._used() > self.max_bytes and len(self._snaps) > 1:
                _, old = self._snaps.popitem(last=False)
                old.tensors = None
                evicted.append(old)
            self.evictions += len(evicted)
        return evicted

    def tensors(self, snap: WeightsSnapshot, sid: str) -> dict[str, torch.Tensor]:
        """``snap``'s tensors (marking it used), or a user error naming why they are gone."""
        with self._lock:
            tensors = snap.tensors
            if tensors is not None and snap.key in self._snaps:
                self._snaps.move_to_end(snap.key)
                return tensors
        raise InputError(f"sampling session {sid}: its weights snapshot (version {snap.version} of model "
                         f"{snap.model_id}) was evicted from memory: the server keeps at most "
                         f"{self.max_bytes / 2**20:.1f} MiB of snapshots (--snapshot-memory), least recently "
                         f"used first; create a new sampling client")

    def remove(self, snap: WeightsSnapshot) -> None:
        with self._lock:
            self._snaps.pop(snap.key, None)
            snap.tensors = None

    def _used(self) -> int:
        return sum(s.nbytes for s in self._snaps.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"count": len(self._snaps), "bytes": self._used(), "max_bytes": self.max_bytes,
                    "evictions": self.evictions}
