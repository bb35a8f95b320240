"""Round-robin turns: :class:`RoundRobin`, the one turn order (the server's compute executor
uses it too), and :class:`FairGate`, turns on one shared resource (a base model that several
clients compute on).

A plain lock lets whichever thread the OS wakes first win, so a client that queues calls
back to back can starve the others. :class:`FairGate` instead hands the resource to the
waiting *keys* (clients) in rotation: after a key's turn it goes to the back of the line,
so with k clients waiting each gets one turn in every k. Within one key, turns are granted
in arrival order (each client's own request order is kept).

:func:`between_micro_batches` is the one place a long call can give way: the micro-batch loop
calls it after every micro-batch but the last, and whoever runs the call on that thread (the
server's compute executor, via :func:`on_micro_batch`) may run other clients' short turns
there or stop the call. Without a hook installed it does nothing.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
M = TypeVar("M", bound=Hashable)
_local = threading.local()


def between_micro_batches() -> None:
    """Called by the micro-batch loop between micro-batches (no graph alive, gradients of the
    finished ones accumulated): runs this thread's hook, if one is installed. The hook may
    raise to stop the call (the loop then fails it as any exception does)."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        hook()


@contextlib.contextmanager
def on_micro_batch(hook: Callable[[], None]) -> Iterator[None]:
    """Install ``hook`` for calls this thread runs inside the block."""
    previous = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = previous


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
    """A reentrant lock whose turns go round-robin across keys (see the module docstring)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._order = RoundRobin()
        self._granted: object | None = None
        self._owner: int | None = None
        self._depth = 0
        #: keys in the order their turns were granted (the scheduler test reads it; bounded)
        self.history: collections.deque = collections.deque(maxlen=1024)

    def waiting(self) -> int:
        """Threads waiting for a turn."""
        with self._cv:
            return self._order.waiting()

    @contextlib.contextmanager
    def turn(self, key: Hashable) -> Iterator[None]:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:  # nested call of the thread that holds the turn
                self._depth += 1
            else:
                ticket = object()
                self._order.add(key, ticket)
                self._grant()
                while self._granted is not ticket:
                    self._cv.wait()
                self._owner, self._depth = me, 1
                self.history.append(key)
        try:
            yield
        finally:
            with self._cv:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._granted = None
                    self._grant()

    def _grant(self) -> None:
        if self._granted is None and (picked := self._order.next()) is not None:
            self._granted = picked[1]
            self._cv.notify_all()
