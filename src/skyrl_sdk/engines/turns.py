"""Turns and steps: how calls share one device without ever running inside each other.

A *stepped call* (:data:`Steps`) is a call cut at its micro-batch boundaries: a generator
that computes one step (a micro-batch, or the checks and planning before the first one) each
time it is resumed, yields at each boundary with no graph alive (the gradients of the finished
micro-batches accumulated), and returns the call's result. Whoever drives it decides at every
boundary what runs next, as vLLM's engine core decides between its steps: the server's compute
executor (``server.compute.executor``) runs other clients' short calls there, from its own
loop, each on a stack of its own, then resumes the paused call; :func:`run_to_end` drives a
call with nobody in between (what ``Backend.forward_backward`` does in process). A call is
never run inside another call's stack, and a turn is never taken inside a turn.

:class:`RoundRobin` is the one turn order (the executor's too), and :class:`FairGate` turns on
one shared resource (a base model that several clients compute on): a plain lock lets
whichever thread the OS wakes first win, so a client that queues calls back to back can starve
the others. :class:`FairGate` instead hands the resource to the waiting *keys* (clients) in
rotation: after a key's turn it goes to the back of the line, so with k clients waiting each
gets one turn in every k. Within one key, turns are granted in arrival order. A stepped call
on a shared base takes one turn per step (:func:`each_step`), so it holds the base only while
it computes.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
M = TypeVar("M", bound=Hashable)
T = TypeVar("T")
#: A stepped call returning ``T``: yields (None) at each micro-batch boundary, returns ``T``.
#: Drive it to its end (or close it) on the thread that started it.
Steps = Generator[None, None, T]
_local = threading.local()


def run_to_end(steps: Steps[T]) -> T:
    """Run a stepped call to its end on this thread, giving way to nobody at its boundaries."""
    counts = getattr(_local, "counts", ())
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        for count in counts:
            count[0] += 1


def one_step(call: Callable[..., T], *args: Any, **kwargs: Any) -> Steps[T]:
    """``call(*args, **kwargs)`` as a stepped call of one step (no boundary): for a call that
    cannot pause, such as one that computes in other processes."""
    yield from ()
    return call(*args, **kwargs)


def each_step(turn: Callable[[], contextlib.AbstractContextManager[Any]], steps: Steps[T]) -> Steps[T]:
    """``steps`` with each step inside a turn of its own (``turn()``): the turn is held while a
    step computes and given back at every boundary, so while the call waits there another call
    may take it. What the driver throws in at a boundary (a stop, or ``close``) reaches ``steps``
    inside a turn too, so the call cleans up holding it."""
    thrown: BaseException | None = None
    try:
        while True:
            with turn():
                try:
                    if thrown is None:
                        next(steps)
                    else:
                        steps.throw(thrown)
                except StopIteration as stop:
                    return stop.value
            try:
                yield
            except BaseException as exc:  # a stop or a close: handed to the call, which re-raises it
                thrown = exc
            else:
                thrown = None
    finally:
        steps.close()  # a no-op once it ended; else (its turn could not be had) it cleans up now


def timed(steps: Steps[T], seconds: list[float]) -> Steps[T]:
    """``steps``, adding to ``seconds[0]`` the time its steps take (not the pauses between them,
    where its driver may run other calls): a call's own compute time, for its throughput."""
    return each_step(lambda: _stopwatch(seconds), steps)


@contextlib.contextmanager
def _stopwatch(seconds: list[float]) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[0] += time.perf_counter() - t0


@contextlib.contextmanager
def count_boundaries() -> Iterator[list[int]]:
    """Count the boundaries of the stepped calls this thread runs with :func:`run_to_end` inside
    the block (the list holds the running total): a call of k micro-batches adds k - 1."""
    count = [0]
    before = getattr(_local, "counts", ())
    _local.counts = (*before, count)
    try:
        yield count
    finally:
        _local.counts = before


class RoundRobin(Generic[K, M]):
    """The one round-robin turn order (no threads, no lock: its user holds one): keys in a
    line, each with its members in order. :meth:`pick` serves the first member, in line
    order, that the caller accepts; its key then goes to the back of the line, and the member
    either leaves (``consume``: a ticket, as :class:`FairGate`'s) or goes to the back of its
    key's members (a client's queue with more work, as the server's executor: owners are the
    keys, their queues the members). A new key joins at the back; a member added again keeps
    its place."""

    def __init__(self) -> None:
        self._line: collections.OrderedDict[K, collections.OrderedDict[M, None]] = collections.OrderedDict()

    def add(self, key: K, member: M) -> None:
        self._line.setdefault(key, collections.OrderedDict())[member] = None

    def discard(self, key: K, member: M) -> None:
        members = self._line.get(key)
        if members is not None:
            members.pop(member, None)
            if not members:
                del self._line[key]

    def pick(self, accept: Callable[[M], bool] | None = None, consume: bool = False) -> tuple[K, M] | None:
        """The next ``(key, member)`` in turn that ``accept`` takes (all, when None), or None."""
        for key, members in self._line.items():
            for member in members:
                if accept is not None and not accept(member):
                    continue
                if consume:
                    del members[member]
                else:
                    members.move_to_end(member)
                if members:
                    self._line.move_to_end(key)
                else:
                    del self._line[key]
                return key, member
        return None

    def next(self) -> tuple[K, M] | None:
        """The next ``(key, ticket)`` to serve, the ticket taken out; None when nobody waits."""
        return self.pick(consume=True)

    def members(self) -> list[M]:
        """Every member, in line order."""
        return [m for members in self._line.values() for m in members]

    def clear(self) -> None:
        self._line.clear()

    def waiting(self) -> int:
        return sum(len(m) for m in self._line.values())


class FairGate:
    """A lock whose turns go round-robin across keys (see the module docstring). Turns never
    nest: the thread that holds one and asks again gets a RuntimeError, not a second turn."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._order: RoundRobin[Hashable, object] = RoundRobin()
        self._granted: object | None = None
        self._owner: int | None = None
        #: keys in the order their turns were granted (the scheduler test reads it; bounded)
        self.history: collections.deque = collections.deque(maxlen=1024)

    def waiting(self) -> int:
        """Threads waiting for a turn."""
        with self._cv:
            return self._order.waiting()

    @property
    def holder(self) -> int | None:
        """The thread (``threading.get_ident()``) holding the turn now; None between turns."""
        return self._owner

    @contextlib.contextmanager
    def turn(self, key: Hashable) -> Iterator[None]:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                raise RuntimeError(f"a turn for {key!r} asked for by the thread that holds one: turns never nest "
                                   f"(a call runs in its own turn, never inside another's)")
            ticket = object()
            self._order.add(key, ticket)
            self._grant()
            while self._granted is not ticket:
                self._cv.wait()
            self._owner = me
            self.history.append(key)
        try:
            yield
        finally:
            with self._cv:
                self._owner = None
                self._granted = None
                self._grant()

    def _grant(self) -> None:
        if self._granted is None and (picked := self._order.next()) is not None:
            self._granted = picked[1]
            self._cv.notify_all()
