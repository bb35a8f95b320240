"""Compute executors: the threads every Backend call runs on, shared fairly between clients.

Why one thread for all the models of a device rather than one per model: every thread that
runs torch grows a glibc malloc arena of its own that keeps an activation working set, so
per-model threads cost each LoRA client roughly the base's bytes again (measured through
the server: 1.1-4.6x the base per client, against 0.04-0.08x on one thread; see
docs/performance.md). So each client gets a :class:`Queue` (what its :class:`~.futures.Sequencer`
feeds), and one :class:`Executor` thread runs the jobs of all of them.

Turns: queues with work are served round-robin by owner, then by queue (client) within the
owner; one turn is one job (or one batch of compatible sample jobs). Between the micro-batches
of a long call the executor decides again, as vLLM's engine core decides between its steps: a
job whose ``run`` returns a stepped call (a generator, :mod:`skyrl_sdk.engines.turns`: a
forward or forward_backward) comes back to the executor's loop at every micro-batch boundary,
*paused*. Every other queue whose next job is small (``cost <= turn_tokens``) then gets one
turn, each run to its end from the loop, on a stack of its own; then the paused call takes its
next step. So a small call waits for one micro-batch of a big call, not for all of it, and no
job ever runs inside another's stack. At most one call is paused at a time (it holds memory:
its outputs so far, its gradients held apart); a job never waits for another queue.

Stopping (server shutdown): queued jobs fail at once with :data:`SHUTDOWN_MESSAGE`; a paused
call is stopped at its boundary (:class:`Stopped` is thrown into it, so it cleans up as on any
error), a running step first finishes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Generator

import attrs

from ...engines.turns import RoundRobin, Steps, run_to_end
from .futures import Job, Result

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = ("the server is shutting down; this request did not run to the end "
                    "(submit it again after the restart)")
#: the answer of a request still running when the server stopped waiting for it (``shutdown_s``)
RUNNING_AT_SHUTDOWN = ("the server stopped while this request was still running; whether it completed is not known "
                       "(a save that completed is listed after the restart)")


class Stopped(Exception):
    """Thrown into a paused call (at its micro-batch boundary) when its executor stops."""


class Queue:
    """One client's jobs on an :class:`Executor`, run one at a time in the order they were put.

    A handle: its state (``jobs``, ``running``, ``closed``, ``last_active``) is read and
    changed only by its executor, under the executor's lock; its methods ask the executor."""

    def __init__(self, executor: Executor, name: str, owner: str, max_batch: int, batch_wait_s: float) -> None:
        self.executor, self.name, self.owner = executor, name, owner
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.jobs: collections.deque[Job] = collections.deque()
        #: why it stopped taking jobs (None while open)
        self.closed: str | None = None
        self.running = False
        self.last_active = time.monotonic()

    def put(self, job: Job) -> None:
        self.executor.put(self, job)

    def close(self, wait: bool = True, timeout: float | None = None,
              why: str = "was shut down (server stopping, model released or sampler evicted)") -> None:
        """Stop taking jobs; queued ones fail; the running one finishes (waited for unless
        ``wait`` is false or this is the executor's own thread)."""
        self.executor.close_queue(self, wait, timeout, why)

    def idle_for(self) -> float:
        """Seconds since this queue last had anything to do (0 while a job is queued or running)."""
        return self.executor.idle_for(self)

    def pending(self) -> int:
        """Jobs queued or running."""
        return self.executor.pending(self)


class Executor:
    """One compute thread serving many :class:`Queue` s in fair turns (see the module docstring)."""

    #: at most this many waits of a queue's ``batch_wait_s`` while gathering one sample batch
    BATCH_WAIT_ROUNDS = 8

    def __init__(self, name: str, turn_tokens: int = 8192, dedicated: bool = False) -> None:
        self.name, self.turn_tokens, self.dedicated = name, turn_tokens, dedicated
        self._cv = threading.Condition()
        #: the queues that have jobs, by owner, in turn order (the one round-robin of engines.turns)
        self._line: RoundRobin[str, Queue] = RoundRobin()
        self._stopping = False
        #: the stepped call waiting at a micro-batch boundary (at most one), and the queues that had
        #: a turn in its current gap
        self._paused: _Paused | None = None
        self._gap_served: set[Queue] = set()
        #: (owner, queue name, in a paused call's gap) of the last turns, oldest first (tests read it)
        self.history: collections.deque = collections.deque(maxlen=1024)
        #: the one compute thread: every job and every micro-batch of a stepped call runs here
        self.thread = threading.Thread(target=self._loop, name=f"skyrl-compute-{name}", daemon=True)
        self.thread.start()

    def queue(self, name: str, owner: str, max_batch: int = 64, batch_wait_s: float = 0.0) -> Queue:
        return Queue(self, name, owner, max_batch, batch_wait_s)

    def alive(self) -> bool:
        return self.thread.is_alive()

    # ---- what a Queue asks ----------------------------------------------------------------------
    def put(self, q: Queue, job: Job) -> None:
        with self._cv:
            if q.closed is None and not self._stopping:
                q.jobs.append(job)
                self._line.add(q.owner, q)
                self._cv.notify_all()
                return
            why = q.closed or "the server is shutting down"
        job.done(Result.error(f"{q.name}: {why}; retry the request", "server"))

    def close_queue(self, q: Queue, wait: bool, timeout: float | None, why: str) -> None:
        with self._cv:
            q.closed = q.closed or why
            dropped = list(q.jobs)
            q.jobs.clear()
            self._line.discard(q.owner, q)
        for job in dropped:
            job.done(Result.error(f"{q.name}: {why}", "server"))
        if self.dedicated:
            self.stop()
        if wait and threading.current_thread() is not self.thread:
            end = None if timeout is None else time.monotonic() + timeout
            with self._cv:
                while q.running:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)

    def idle_for(self, q: Queue) -> float:
        with self._cv:
            if q.running or q.jobs:
                return 0.0
            return time.monotonic() - q.last_active

    def pending(self, q: Queue) -> int:
        with self._cv:
            return len(q.jobs) + q.running

    # ---- the line (holding the condition) -----------------------------------------------------
    def _pick(self, exclude: set, small: bool) -> Queue | None:
        """The next queue in turn (moved to the back of its owner's line, and the owner to the
        back of the line), skipping running and ``exclude``d ones; ``small``: only a queue whose
        next job costs at most ``turn_tokens``."""
        def accept(q: Queue) -> bool:
            return not q.running and q not in exclude and (not small or self._small_head(q))

        picked = self._line.pick(accept)
        return None if picked is None else picked[1]

    def _small_head(self, q: Queue) -> bool:
        return bool(q.jobs) and q.jobs[0].cost is not None and q.jobs[0].cost <= self.turn_tokens

    def _others_ready(self, q: Queue) -> bool:
        return any(other is not q for other in self._line.members())

    def _take(self, q: Queue, wait: bool) -> list[Job]:
        """Pop ``q``'s next job, with the compatible sample jobs behind it; with ``wait``, wait
        up to ``batch_wait_s`` for each next one while no other queue has work."""
        first = q.jobs.popleft()
        q.running = True
        batch = [first]
        if first.batch_key is not None and first.run_batch is not None:
            waits = self.BATCH_WAIT_ROUNDS if wait and q.batch_wait_s > 0 else 0
            while len(batch) < q.max_batch:
                if q.jobs:
                    if q.jobs[0].batch_key != first.batch_key:
                        break
                    batch.append(q.jobs.popleft())
                    continue
                if waits <= 0 or self._stopping or q.closed or self._others_ready(q):
                    break
                waits -= 1
                self._cv.wait(q.batch_wait_s)
                if not q.jobs:
                    break
        if not q.jobs:
            self._line.discard(q.owner, q)
        return batch

    # ---- running: one decision per step, from this loop only -------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and self._paused is None and (q := self._pick(set(), small=False)) is None:
                    self._cv.wait()
                if self._paused is not None:
                    paused = self._paused
                    q = None if self._stopping else self._pick(self._gap_served | {paused.queue}, small=True)
                    if q is not None:  # a small job of another client runs in the gap, then the paused call
                        self._gap_served.add(q)
                        batch = self._take(q, wait=False)
                elif self._stopping:
                    return
                else:
                    assert q is not None  # the wait ends with a queue when nothing is paused or stopping
                    paused, batch = None, self._take(q, wait=True)
            if paused is None and q is not None:
                self._start(q, batch)
            elif q is not None:
                self._run_to_end(q, batch)
            elif paused is not None:
                self._resume(paused)

    def _start(self, q: Queue, batch: list[Job]) -> None:
        """A new turn: run ``batch``; a stepped job takes its first step and may pause."""
        self.history.append((q.owner, q.name, False))
        if len(batch) > 1:
            self._finish(q, batch, _run_batch(batch))
            return
        job = batch[0]
        try:
            out = job.run()
        except BaseException as exc:
            self._finish(q, batch, [_failed(exc, job)])
            return
        if not isinstance(out, Generator):
            self._finish(q, batch, [out])
            return
        self._step(_Paused(q, job, out), None)

    def _resume(self, paused: _Paused) -> None:
        """The paused call's next step (or, when stopping, its stop)."""
        with self._cv:
            self._paused, self._gap_served = None, set()
            stop = Stopped(SHUTDOWN_MESSAGE) if self._stopping else None
        self._step(paused, stop)

    def _step(self, call: _Paused, throw: BaseException | None) -> None:
        """One step of a stepped call; it pauses at its next boundary, or ends."""
        try:
            if throw is None:
                next(call.steps)
            else:
                call.steps.throw(throw)
        except StopIteration as end:
            self._finish(call.queue, [call.job], [end.value])
        except BaseException as exc:
            self._finish(call.queue, [call.job], [_failed(exc, call.job)])
        else:
            with self._cv:
                self._paused = call

    def _run_to_end(self, q: Queue, batch: list[Job]) -> None:
        """A turn in a paused call's gap: the job runs to its end (it does not give way again)."""
        self.history.append((q.owner, q.name, True))
        if len(batch) > 1:
            results = _run_batch(batch)
        else:
            job = batch[0]
            try:
                out = job.run()
                results = [run_to_end(out) if isinstance(out, Generator) else out]
            except BaseException as exc:
                results = [_failed(exc, job)]
        self._finish(q, batch, results)

    def _finish(self, q: Queue, batch: list[Job], results: list[Result | None]) -> None:
        for job, result in zip(batch, results, strict=True):
            if result is None:  # the job handed itself on to another queue
                continue
            try:
                job.done(result)
            except Exception:  # pragma: no cover - a callback bug must not kill the executor
                logger.exception("result callback of %s failed", job.what)
        with self._cv:
            q.running = False
            q.last_active = time.monotonic()
            self._cv.notify_all()

    # ---- lifetime -------------------------------------------------------------------------------
    def stop(self) -> None:
        """Fail every queued job, close every queue; a paused call stops at its boundary."""
        with self._cv:
            self._stopping = True
            dropped: list[Job] = []
            for q in self._line.members():
                dropped += q.jobs
                q.jobs.clear()
                q.closed = q.closed or "the server is shutting down"
            self._line.clear()
            self._cv.notify_all()
        for job in dropped:
            job.done(Result.error(SHUTDOWN_MESSAGE, "server"))

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to end (after :meth:`stop`); whether it did."""
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        return not self.thread.is_alive()


@attrs.define(eq=False)
class _Paused:
    """A stepped call between two of its steps: its queue, its job, the call."""

    queue: Queue
    job: Job
    steps: Steps[Result]


def _failed(exc: BaseException, job: Job) -> Result:
    if isinstance(exc, Stopped):
        return Result.error(SHUTDOWN_MESSAGE, "server")
    return Result.from_exception(exc, job.what)


def _run_batch(batch: list[Job]) -> list[Result | None]:
    """A batch of compatible sample jobs, together; one by one when together fails."""
    run_batch = batch[0].run_batch
    assert run_batch is not None  # only jobs with a run_batch are taken together
    try:
        return run_batch(batch)
    except BaseException:
        logger.debug("batched %s failed; running its %d jobs one by one", batch[0].what, len(batch))
    results: list[Result | None] = []
    for job in batch:
        try:
            out = job.run()
            results.append(run_to_end(out) if isinstance(out, Generator) else out)
        except BaseException as exc:
            results.append(_failed(exc, job))
    return results


class Executors:
    """A server's executors: one shared by every model computing in this process (the local
    engine: one device), or, for engines that compute in processes of their own (``fsdp``),
    one per queue, so their models keep progressing side by side."""

    def __init__(self, shared: bool, turn_tokens: int = 8192) -> None:
        self.turn_tokens = turn_tokens
        self.shared = Executor("shared", turn_tokens) if shared else None
        self._dedicated: list[Executor] = []

    def queue(self, name: str, owner: str, max_batch: int = 64, batch_wait_s: float = 0.0,
              dedicated: bool = False) -> Queue:
        """A queue on the shared executor, or (engines in processes of their own, or ``dedicated``:
        work on another resource, such as samples of engines apart from the trainer) its own."""
        ex = None if dedicated else self.shared
        if ex is None:
            ex = Executor(name, self.turn_tokens, dedicated=True)
            self._dedicated = [e for e in self._dedicated if e.alive()] + [ex]
        return ex.queue(name, owner, max_batch, batch_wait_s)

    def all(self) -> list[Executor]:
        return ([self.shared] if self.shared is not None else []) + list(self._dedicated)

    def stop(self) -> None:
        for ex in self.all():
            ex.stop()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for every executor to end; whether all did."""
        return all([ex.join(max(0.0, deadline - time.monotonic())) for ex in self.all()])

    async def settle(self, deadline: float, give_up: Callable[[], bool]) -> None:
        """(event loop) Wait until no executor runs a job, ``deadline`` (monotonic) passes or
        ``give_up()``; then one more turn of the loop, so a result queued from a thread is delivered."""
        while any(ex.alive() for ex in self.all()) and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0)
