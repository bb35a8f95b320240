"""Pushing weights from where they live to an inference engine in another place, never through disk.

A sampler that holds its own copy of the weights in other processes (vLLM engines placed by Ray,
or an engine beside an ``fsdp`` controller whose ranks hold the weights) asks its
:class:`~skyrl_sdk.plugins.samplers.WeightsSource` to *push* them:

1. :meth:`WeightsSource.push_layout` says what a push sends, without sending anything: every
   tensor's name (Hugging Face names: what ``export_base`` writes), wire dtype and full shape,
   and which rows of its first dimension each *trainer rank* holds. An in-process engine is
   one rank holding everything; an ``fsdp`` engine's ranks each hold their FSDP shard's rows,
   and each sends only those (no rank gathers the model).
2. :meth:`WeightsSource.push_weights` runs a :class:`WeightSender` on every trainer rank, where
   the weights live, with that rank's slices in layout order. The sender is named by import
   path in a :class:`PushTarget` of plain data (it crosses processes as such), built once per
   process and kept (its connections persist from push to push).

The receiving side (the inference engine) is the sampler plugin's business: it gets the same
layout and reassembles each tensor from its rows. The core knows no transport.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from ..errors import InputError, PluginError


@attrs.frozen
class TensorSlices:
    """One tensor of a push: ``rows[r]`` is the ``[start, stop)`` range of dimension 0 that
    trainer rank ``r`` sends (empty when it holds none); a 0-d tensor is sent whole by the one
    rank whose range is ``(0, 1)``."""

    name: str
    #: the dtype on the wire (torch's name without ``torch.``: ``"bfloat16"``)
    dtype: str
    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]

    def slice_shape(self, rank: int) -> tuple[int, ...]:
        start, stop = self.rows[rank]
        if not self.shape:
            return () if stop > start else (0,)
        return (stop - start, *self.shape[1:])

    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=wire_dtype(self.dtype)).element_size()


@attrs.frozen
class PushLayout:
    """What a push sends, in order (see the module docstring); plain data round trips through
    :meth:`to_plain` / :meth:`from_plain`. ``gathered``: rank 0 sends every tensor whole, the other
    ranks taking part in gathering each (a transport with one sender)."""

    ranks: int
    tensors: tuple[TensorSlices, ...]
    gathered: bool = False

    def __attrs_post_init__(self) -> None:
        for t in self.tensors:
            if len(t.rows) != self.ranks:
                raise ValueError(f"push layout: tensor {t.name!r} gives rows for {len(t.rows)} ranks, not {self.ranks}")
            covered = sorted((a, b) for a, b in t.rows if b > a)
            total = t.shape[0] if t.shape else 1
            if sum(b - a for a, b in covered) != total or any(
                    prev[1] != nxt[0] for prev, nxt in zip(covered, covered[1:], strict=False)):
                raise ValueError(f"push layout: the rows of {t.name!r} {t.rows} do not cover 0..{total} once")

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in self.tensors)

    def to_plain(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "gathered": self.gathered,
                "tensors": [[t.name, t.dtype, list(t.shape), [list(r) for r in t.rows]] for t in self.tensors]}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> PushLayout:
        return cls(ranks=int(plain["ranks"]), gathered=bool(plain.get("gathered", False)), tensors=tuple(
            TensorSlices(name=n, dtype=d, shape=tuple(int(x) for x in s), rows=tuple((int(a), int(b)) for a, b in r))
            for n, d, s, r in plain["tensors"]))

    @classmethod
    def merge(cls, per_rank: list[list[tuple[str, str, tuple[int, ...], tuple[int, int]]]],
              gathered: bool = False) -> PushLayout:
        """The layout of ``per_rank[r]``: rank r's ``(name, dtype, full shape, its rows)``, the same
        names in the same order on every rank (what each ``fsdp`` rank reports)."""
        first = per_rank[0]
        for r, mine in enumerate(per_rank):
            if [m[:3] for m in mine] != [m[:3] for m in first]:
                raise ValueError(f"push layout: rank {r} reports other tensors than rank 0")
        return cls(ranks=len(per_rank), gathered=gathered, tensors=tuple(
            TensorSlices(name=name, dtype=dtype, shape=tuple(shape),
                         rows=tuple((int(ranks[i][3][0]), int(ranks[i][3][1])) for ranks in per_rank))
            for i, (name, dtype, shape, _) in enumerate(first)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout's dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"push layout: {name!r} is not a torch dtype")
    return dtype


def local_slice(tensor: torch.Tensor, rows: tuple[int, int], dtype: str, offset: int = 0) -> torch.Tensor:
    """Rows ``rows`` of ``tensor`` (which holds rows from ``offset`` on: a shard), in the wire
    dtype (floating tensors are cast; others keep theirs), contiguous."""
    start, stop = rows
    if tensor.dim() == 0:
        out = tensor if stop > start else tensor.new_empty((0,))
    else:
        out = tensor[start - offset:stop - offset]
    if out.is_floating_point():
        out = out.to(wire_dtype(dtype))
    return out.detach().contiguous()


@attrs.frozen
class PushTarget:
    """Where a push goes: ``sender`` names a :class:`WeightSender` subclass as
    ``"package.module:Class"``, built with ``options`` (plain data) on each trainer rank. ``key``
    names the pushing sampler: a process keeps one sender per key, reused from push to push,
    and replaced (the old one closed) when ``generation`` moves (its engines were restarted)."""

    sender: str
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    key: str = ""
    generation: int = 0

    def to_plain(self) -> dict[str, Any]:
        return {"sender": self.sender, "options": dict(self.options), "key": self.key, "generation": self.generation}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> PushTarget:
        return cls(sender=plain["sender"], options=plain["options"], key=plain["key"],
                   generation=int(plain.get("generation", 0)))


class WeightSender(ABC):
    """Sends one trainer rank's slices of a push (a sampler plugin implements it for its transport).

    Built as ``cls(**target.options)`` the first time a process pushes to a target, then reused;
    :meth:`close` when the target is dropped (its engine restarted or closed)."""

    @abstractmethod
    def send(self, rank: int, layout: PushLayout, slices: Iterator[torch.Tensor]) -> None:
        """Send ``slices`` (this rank's rows of each tensor of ``layout``, in order, in the wire
        dtype) to the engines; return when they are sent."""

    def close(self) -> None:  # noqa: B027  (optional: a sender may hold nothing)
        """Free connections; idempotent."""


_senders: dict[str, tuple[int, WeightSender]] = {}
_senders_lock = threading.Lock()


def sender_for(target: PushTarget) -> WeightSender:
    """This process's sender of ``target`` (built on first use, rebuilt for a new generation)."""
    with _senders_lock:
        generation, sender = _senders.get(target.key, (None, None))
        if sender is not None and generation == target.generation:
            return sender
        if sender is not None:
            sender.close()
        module, _, name = target.sender.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise PluginError(f"weight push: cannot import the sender {target.sender!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, WeightSender)):
            raise PluginError(f"weight push: {target.sender!r} is not a skyrl_sdk WeightSender subclass")
        sender = cls(**target.options)
        _senders[target.key] = (target.generation, sender)
        return sender


def drop_sender(key: str) -> None:
    """Close and forget this process's sender of the target ``key`` (if any)."""
    with _senders_lock:
        _, sender = _senders.pop(key, (None, None))
    if sender is not None:
        sender.close()


def push_slices(target: PushTarget, rank: int, layout: PushLayout, slices: Iterator[torch.Tensor]) -> None:
    """Rank ``rank``'s part of a push: its sender sends ``slices``. A failed send drops the sender
    (its connections are unusable), so the next push to ``target`` starts afresh."""
    sender = sender_for(target)
    try:
        sender.send(rank, layout, slices)
    except BaseException:
        drop_sender(target.key)
        raise
