"""One call at a time on a Backend: its call slot.

Why a slot and not a lock: a stepped call (:mod:`.turns`) leaves its stack at every micro-batch
boundary, so a re-entrant lock held across its yields lets the thread that drives it run any
other call in the pause: an ``optim_step`` on half a call's gradients, or a second
``forward_backward`` whose gradients mix with the paused one's. Nothing would say so. The slot
holds the *active call* (its name, the thread of its last step, whether it is paused at a
boundary) and decides, for every other call on the same Backend:

- the active call is **paused**: refused at once, from any thread, naming it (:class:`CallInProgressError`);
- it is **running** on the caller's own thread (a call made from inside another, say by a loss
  plugin): refused at once, as waiting would never end;
- it is **running** on another thread: the caller waits for the slot, then decides again.

A refusal changes nothing: the paused call goes on as if nobody had asked. Two internal callers
wait through a pause instead of being refused (``wait_if_paused``): the weights sync of a sampler
that runs apart from the trainer (its samples overlap training by design), and ``close`` from
another thread. The server's compute executor never runs a call on a Backend whose call it has
paused (its queue is left out of the gap), so it goes through the slot unrefused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

import attrs

from ..errors import CallInProgressError
from .turns import Steps, each_step

T = TypeVar("T")


@attrs.define
class ActiveCall:
    """The call holding a slot: its name, the thread that ran its last step, and whether it is
    paused at a micro-batch boundary (a stepped call whose driver has not resumed it yet)."""

    name: str
    thread: int
    paused: bool = False


class CallSlot:
    """The slot of one Backend (``what`` names it in errors): see the module docstring."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._cv = threading.Condition()
        self._active: ActiveCall | None = None

    @property
    def active(self) -> ActiveCall | None:
        """The call holding the slot now (a copy), or None."""
        with self._cv:
            return None if self._active is None else attrs.evolve(self._active)

    @contextlib.contextmanager
    def call(self, name: str, *, wait_if_paused: bool = False) -> Iterator[None]:
        """Hold the slot for a call that runs to its end inside the block."""
        self._enter(name, wait_if_paused)
        try:
            yield
        finally:
            self._leave()

    def stepped(self, name: str, steps: Steps[T]) -> Steps[T]:
        """``steps`` holding the slot from its first step to its end: paused at each boundary,
        running during each step. The slot is taken when the driver asks for the first step (so
        a refusal comes from that ``next``), and given back when the call ends, fails or is
        closed (also by the garbage collector, for a call its driver dropped)."""
        try:
            self._enter(name, wait_if_paused=False)
        except BaseException:
            steps.close()
            raise
        try:
            return (yield from each_step(self._running, steps))
        finally:
            self._leave()

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """One step of the active stepped call: running on this thread, paused again after it."""
        with self._cv:
            assert self._active is not None  # only stepped() steps, between its _enter and _leave
            self._active.thread, self._active.paused = threading.get_ident(), False
        try:
            yield
        finally:
            with self._cv:
                assert self._active is not None
                self._active.paused = True
                self._cv.notify_all()  # a caller waiting for the slot is refused now, not at the end

    def _enter(self, name: str, wait_if_paused: bool) -> None:
        me = threading.get_ident()
        with self._cv:
            while (active := self._active) is not None:
                if active.thread == me or (active.paused and not wait_if_paused):
                    raise CallInProgressError(self._refusal(name, active, me))
                self._cv.wait()
            self._active = ActiveCall(name, me)

    def _leave(self) -> None:
        with self._cv:
            self._active = None
            self._cv.notify_all()

    def _refusal(self, name: str, active: ActiveCall, me: int) -> str:
        if active.paused:
            fix = ("drive the paused call to its end (turns.run_to_end) or close() it first; a Backend runs one "
                   "call at a time, and a stepped call holds it from its first step to its end")
        else:
            fix = "a call cannot be made from inside another call on the same Backend (it would wait for itself)"
        where = "this thread" if active.thread == me else f"thread {active.thread}"
        return (f"{name} refused on {self.what}: its call {active.name} is "
                f"{'paused at a micro-batch boundary' if active.paused else 'running'} on {where}; {fix}")
