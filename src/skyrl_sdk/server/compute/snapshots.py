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
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any

import attrs
import torch

from ...engines.adapter import AdapterEngine
from ...engines.local import LocalEngine
from ...errors import EngineError, InputError


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


def _turn(engine: Any):
    """The adapter's turn on its shared base (reloads it if offloaded), else nothing."""
    if isinstance(engine, AdapterEngine):
        return engine.shared.using(engine.adapter)
    return contextlib.nullcontext()


def supports_memory_snapshots(backend: Any) -> bool:
    """Whether the backend's engine exposes its trainable tensors (the local engine and adapters
    on a shared base do; other engines snapshot to disk)."""
    return isinstance(getattr(backend, "engine", None), LocalEngine)


def take_tensors(backend: Any, max_bytes: int) -> tuple[dict[str, torch.Tensor] | None, int]:
    """CPU copies of the backend's trainable tensors and their bytes, or (None, bytes) when
    they would exceed ``max_bytes`` (nothing is copied then)."""
    engine = backend.engine
    with _turn(engine):
        params = engine.runner.named_trainable()
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        if nbytes > max_bytes:
            return None, nbytes
        return {name: p.detach().to("cpu", copy=True) for name, p in params}, nbytes


def load_tensors(backend: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a snapshot's tensors into a sampler Backend built like the snapshotted one."""
    engine = backend.engine
    with _turn(engine), torch.no_grad():
        params = dict(engine.runner.named_trainable())
        if params.keys() != tensors.keys():
            missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
            raise EngineError(f"weights snapshot does not fit its sampler: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}")
        for name, p in params.items():
            p.copy_(tensors[name])
    backend.weights_changed()  # a sampler holding its own copy of the weights reloads them


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
