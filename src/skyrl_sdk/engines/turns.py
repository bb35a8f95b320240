"""Round-robin turns on one shared resource (a base model that several clients compute on).

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


class RoundRobin:
    """The pure turn order (no threads): keys queue tickets; :meth:`next` picks the next one.

    The key at the front of the line is served one ticket, then moves to the back if it has
    more (a new key joins at the back)."""

    def __init__(self) -> None:
        self._line: collections.OrderedDict[Hashable, collections.deque] = collections.OrderedDict()

    def add(self, key: Hashable, ticket: object) -> None:
        self._line.setdefault(key, collections.deque()).append(ticket)

    def next(self) -> tuple[Hashable, object] | None:
        """The next ``(key, ticket)`` to serve, or None when nobody waits."""
        if not self._line:
            return None
        key, tickets = next(iter(self._line.items()))
        ticket = tickets.popleft()
        if tickets:
            self._line.move_to_end(key)
        else:
            del self._line[key]
        return key, ticket

    def waiting(self) -> int:
        return sum(len(t) for t in self._line.values())


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
