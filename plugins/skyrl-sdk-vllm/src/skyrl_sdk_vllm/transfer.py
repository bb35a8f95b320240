"""The ``gloo`` weight-transfer backend's wire, and its trainer side (imports torch, never vLLM).

vLLM's weight-transfer API (``LLM.init_weight_transfer_engine``, ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``) ships GPU backends (``nccl``, ``ipc``); this
plugin adds ``gloo`` (:mod:`.transfer_engine`, registered with vLLM's factory) so the same
start / update / finish path runs on CPUs, between processes and machines.

The wire. A push's :class:`~skyrl_sdk.plugins.weight_push.PushLayout` lists each tensor and the
rows of its first dimension each trainer rank holds. The tensors are cut into *buckets* of
consecutive tensors (by their full size, ``bucket_bytes``, so every side cuts alike); for each
bucket every trainer rank packs its rows of the bucket's tensors into one byte buffer and sends
it to every vLLM worker (point to point: no trainer rank receives another's bytes, and none
gathers the model); a worker receives one buffer from each trainer rank, puts each tensor's rows
together and loads it. One group per engine: the trainer ranks are its ranks ``0..N-1``, the
engine's tensor-parallel workers ``N..N+T-1``; the controller hosts its rendezvous store.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from skyrl_sdk.plugins.weight_push import PushLayout, WeightSender, wire_dtype

#: the default bucket: large enough that per-message costs vanish, small enough to stay a
#: fraction of a rank's memory
DEFAULT_BUCKET_BYTES = 64 * 2**20


def buckets(layout: PushLayout, bucket_bytes: int) -> list[list[int]]:
    """The tensors' indices, cut into consecutive buckets of at most ``bucket_bytes`` (full
    sizes; a tensor larger than that is a bucket of its own)."""
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, t in enumerate(layout.tensors):
        n = t.nbytes()
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        out.append(current)
    return out


def _slice_bytes(layout: PushLayout, index: int, rank: int) -> int:
    t = layout.tensors[index]
    n = 1
    for s in t.slice_shape(rank):
        n *= s
    return n * torch.empty((), dtype=wire_dtype(t.dtype)).element_size()


def packed_bytes(layout: PushLayout, indices: Sequence[int], rank: int) -> int:
    """The size of rank ``rank``'s buffer for the bucket ``indices``."""
    return sum(_slice_bytes(layout, i, rank) for i in indices)


def pack(slices: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer of the slices' bytes, in order."""
    parts = [s.contiguous().reshape(-1).view(torch.uint8) for s in slices if s.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buffer: torch.Tensor, layout: PushLayout, indices: Sequence[int], rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s slices of the bucket ``indices`` from its buffer (views, no copy)."""
    out, offset = [], 0
    for i in indices:
        t = layout.tensors[i]
        n = _slice_bytes(layout, i, rank)
        out.append(buffer[offset:offset + n].view(wire_dtype(t.dtype)).reshape(t.slice_shape(rank)))
        offset += n
    return out


def assemble(layout: PushLayout, index: int, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """A whole tensor from each trainer rank's rows (``pieces[r]``), in row order."""
    t = layout.tensors[index]
    if not t.shape:
        return next(p for p, (a, b) in zip(pieces, t.rows, strict=True) if b > a).reshape(())
    ordered = [p for (a, b), p in sorted(zip(t.rows, pieces, strict=True), key=lambda x: x[0][0]) if b > a]
    return ordered[0] if len(ordered) == 1 else torch.cat(ordered)


def open_group(host: str, port: int, prefix: str, rank: int, world_size: int,
               timeout_s: float) -> dist.ProcessGroupGloo:
    """Join one transfer group (a gloo process group of its own: the default process group, a
    trainer's or vLLM's, is never touched) through the store at ``host:port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, timeout)


class GlooSender(WeightSender):
    """A trainer rank's side of the ``gloo`` backend: one group per engine (``groups``: each
    ``{"host", "port", "prefix", "world_size"}``), joined at the first push, kept after."""

    def __init__(self, *, groups: Sequence[Mapping[str, Any]], trainer_ranks: int, timeout_s: float,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.specs = [dict(g) for g in groups]
        self.trainer_ranks = int(trainer_ranks)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self.groups: list[Any] | None = None

    def _join(self, rank: int) -> list[Any]:
        if self.groups is None:
            self.groups = [open_group(g["host"], int(g["port"]), g["prefix"], rank, int(g["world_size"]),
                                      self.timeout_s) for g in self.specs]
        return self.groups

    def send(self, rank: int, layout: PushLayout, slices: Iterator[torch.Tensor]) -> None:
        groups = self._join(rank)
        for tag, indices in enumerate(buckets(layout, self.bucket_bytes)):
            buffer = pack([next(slices) for _ in indices]).cpu()  # gloo sends host memory (a GPU rank's too)
            if buffer.numel() != packed_bytes(layout, indices, rank):
                raise RuntimeError(f"weight push: rank {rank}'s slices of bucket {tag} are {buffer.numel()} bytes, "
                                   f"the layout says {packed_bytes(layout, indices, rank)}")
            if not buffer.numel():
                continue
            works = [pg.send([buffer], worker, tag) for pg, spec in zip(groups, self.specs, strict=True)
                     for worker in range(self.trainer_ranks, int(spec["world_size"]))]
            for work in works:
                work.wait()

    def close(self) -> None:
        self.groups = None


def receive(pg: Any, layout: PushLayout, trainer_ranks: int, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """A worker's side: each bucket's tensors, whole, as ``[(name, tensor), ...]``."""
    for tag, indices in enumerate(buckets(layout, bucket_bytes)):
        buffers = [torch.empty(packed_bytes(layout, indices, r), dtype=torch.uint8) for r in range(trainer_ranks)]
        works = [pg.recv([b], r, tag) for r, b in enumerate(buffers) if b.numel()]
        for work in works:
            work.wait()
        per_rank = [unpack(b, layout, indices, r) for r, b in enumerate(buffers)]
        yield [(layout.tensors[i].name, assemble(layout, i, [per_rank[r][k] for r in range(trainer_ranks)]))
               for k, i in enumerate(indices)]
