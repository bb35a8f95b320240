"""Futures: accepted at once, run per model in ``seq_id`` order, retrieved by long-poll.

- :class:`Job` - one request's work for a model's queue on a compute executor
  (:mod:`.executor`, which runs it and reports its :class:`Result`).
- :class:`Sequencer` - per training model, on the event loop: hands jobs to the model's
  queue in ``seq_id`` order, holding later ones until the earlier ones arrived (the client
  may send a batch's chunks in parallel, first chunk last).
- :class:`FutureStore` - request id -> result, with ``(model_id, seq_id)`` de-duplication
  so a retried submission gets the original request id and never runs twice.

Everything here runs on the event loop thread, so none of it needs locks; results cross
from the executor's thread with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
import traceback
import uuid
from collections.abc import Callable, Hashable
from typing import Any

import attrs

from ...engines.turns import Steps
from ...errors import InputError, PluginError, clipped

logger = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@attrs.frozen
class Result:
    """A finished request's answer: the exact body and content type retrieve_future sends."""

    body: bytes
    media_type: str = JSON
    failed: bool = False

    @classmethod
    def json(cls, obj: Any) -> Result:
        """``obj`` as strict JSON: NaN and infinities (not JSON; the client's parser rejects
        them) become null."""
        return cls(json.dumps(finite_json(obj), allow_nan=False).encode(), JSON)

    @classmethod
    def proto(cls, data: bytes) -> Result:
        return cls(data, PROTOBUF)

    @classmethod
    def error(cls, message: str, category: str) -> Result:
        return cls(json.dumps({"error": clipped(message), "category": category}).encode(), JSON, failed=True)

    @classmethod
    def from_exception(cls, exc: BaseException, what: str = "request") -> Result:
        """Classified by our own types: :class:`InputError` (bad input) -> category "user" with
        the SDK's message; :class:`PluginError` (a plugin returned something malformed: not the
        caller's fault) -> "server", saying so; anything else (a bare ``ValueError`` from
        torch included) is our fault -> "server"."""
        if isinstance(exc, InputError):
            return cls.error(str(exc) or type(exc).__name__, "user")
        logger.error("%s failed:\n%s", what, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        if isinstance(exc, PluginError):
            return cls.error(f"a server plugin failed in {what} (not a problem with your request): {exc}", "server")
        return cls.error(f"internal server error in {what}: {type(exc).__name__}: {exc}", "server")


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (recursively)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


@attrs.define(eq=False)
class Job:
    """Work for a queue of an executor. ``run`` returns a :class:`Result` (exceptions are
    turned into error results) that ``done`` receives on the executor's thread, or None when
    it handed the work on to another queue (which then calls ``done``), or a stepped call
    (a generator, ``engines.turns.Steps``) that yields at each micro-batch boundary, where the
    executor may run other jobs, and returns the Result.

    Jobs with the same non-None ``batch_key`` that sit next to each other in the queue are
    handed together to ``run_batch`` (which returns one Result per job). ``cost`` (tokens,
    roughly) says how long it runs: a job of at most the executor's ``turn_tokens`` may run
    between another job's micro-batches; None: never (saves, loads, model creation)."""

    run: Callable[[], Result | Steps[Result] | None]
    done: Callable[[Result], None]
    what: str = "request"
    batch_key: Hashable | None = None
    run_batch: Callable[[list[Job]], list[Result | None]] | None = None
    payload: Any = None
    cost: int | None = None


class Sequencer:
    """Hands a model's jobs to its queue (``worker``: put, idle_for, name) in ``seq_id``
    order (event-loop side).

    The tinker client numbers every training request of a model, and sends request ``n + 1``
    only once request ``n``'s submission was answered, or failed on its side (it never
    reached us: a datum it could not encode) -- except the chunks of one parallel
    ``forward_backward``, which it sends together. So a request that arrives as a
    *boundary* (``boundary=True``: everything numbered before it was already submitted)
    shows that the seq_ids missing below it will not come: they are skipped once it has
    waited ``boundary_grace_s`` (a short grace, for a client of its own that sends out of
    order; the ids that arrive within it keep their order). The runtime marks every request a
    boundary when the server tells clients not to send chunks in parallel (its default), and
    every request but a ``forward_backward`` otherwise. A request that is not a boundary
    waits for a missing seq_id until the model's queue has been idle for ``gap_timeout_s``
    with later requests waiting (a chunk of the same call, still on its way, arrives well
    within that), so one lost request cannot stall a model forever, while a slow forward pass
    never causes a skip. A skipped seq_id that arrives after all is refused (it would run out
    of order). Jobs without a seq_id go straight through."""

    def __init__(self, worker: Any, next_seq: int = 1, gap_timeout_s: float = 30.0,
                 boundary_grace_s: float = 0.0) -> None:
        self.worker = worker
        self.next_seq = next_seq
        self.gap_timeout_s = gap_timeout_s
        self.boundary_grace_s = boundary_grace_s
        self._waiting: dict[int, Job] = {}
        self._gap_timer: asyncio.TimerHandle | None = None
        #: the highest boundary waiting for a gap below it, and the timer that ends its grace
        self._proof: int | None = None
        self._grace_timer: asyncio.TimerHandle | None = None

    def held(self) -> list[int]:
        """The seq_ids held back, waiting for a lower one (ascending)."""
        return sorted(self._waiting)

    def submit(self, seq_id: int | None, job: Job, *, boundary: bool = False) -> None:
        if seq_id is None:
            self.worker.put(job)
            return
        if seq_id < self.next_seq:
            logger.warning("%s: seq_id %d arrived after %d ran; refusing it", self.worker.name, seq_id,
                           self.next_seq - 1)
            job.done(Result.error(f"seq_id {seq_id} arrived after later requests of this model ran (it was taken "
                                  f"as never sent); it was not run, to keep the model's requests in order",
                                  "server"))
            return
        self._waiting[seq_id] = job
        if boundary and seq_id > self.next_seq:
            self._proof = max(seq_id, self._proof or 0)
            if self.boundary_grace_s <= 0:
                self._end_grace()
                return
            if self._grace_timer is None:
                self._grace_timer = asyncio.get_running_loop().call_later(self.boundary_grace_s, self._end_grace)
        self._drain()

    def _end_grace(self) -> None:
        """The grace of the waiting boundaries is over: the ids still missing below them are skipped."""
        self._grace_timer = None
        if self._proof is not None and self._proof > self.next_seq:
            self._skip_below(self._proof, "the client sent a later request, so they will not come")
        self._proof = None
        self._drain()

    def _skip_below(self, seq_id: int, why: str) -> None:
        """Hand on, in order, the jobs waiting below ``seq_id``, skipping the ids missing
        between them (by the waiting jobs, not id by id: a seq_id may be any size)."""
        for waiting in sorted(k for k in self._waiting if k < seq_id) + [seq_id]:
            if waiting > self.next_seq:
                logger.warning("%s: seq_id %d..%d never arrived (%s); skipping to %d", self.worker.name,
                               self.next_seq, waiting - 1, why, waiting)
                self.next_seq = waiting
            if waiting < seq_id:
                self.worker.put(self._waiting.pop(waiting))
                self.next_seq = waiting + 1

    def _drain(self) -> None:
        while self.next_seq in self._waiting:
            self.worker.put(self._waiting.pop(self.next_seq))
            self.next_seq += 1
        if self._proof is not None and self._proof < self.next_seq:  # the gap filled within the grace
            self._proof = None
            if self._grace_timer is not None:
                self._grace_timer.cancel()
                self._grace_timer = None
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None
        if self._waiting:
            loop = asyncio.get_running_loop()
            self._gap_timer = loop.call_later(self.gap_timeout_s, self._skip_gap)

    def _skip_gap(self) -> None:
        self._gap_timer = None
        if not self._waiting:
            return
        idle = self.worker.idle_for()
        if idle < self.gap_timeout_s:
            self._gap_timer = asyncio.get_running_loop().call_later(self.gap_timeout_s - idle + 0.01, self._skip_gap)
            return
        self._skip_below(min(self._waiting), f"waited {self.gap_timeout_s:.0f}s with the model idle")
        self._drain()

    def fail_pending(self, message: str) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        for job in self._waiting.values():
            job.done(Result.error(message, "server"))
        self._waiting.clear()


@attrs.define(eq=False)
class FutureRecord:
    request_id: str
    owner: str
    model_id: str | None
    created_at: float
    event: asyncio.Event
    result: Result | None = None
    retrieved_at: float | None = None
    dedup_key: tuple | None = None
    extra: dict = attrs.Factory(dict)


class FutureStore:
    """Request id -> record; lives on the event loop. Every record belongs to an owner: another
    owner's request id reads as unknown, and de-duplication keys include the owner.

    A de-duplication key whose record was swept (results are kept ``retention_s`` after
    retrieval) is remembered for ``expired_horizon_s`` more (at most ``max_expired`` keys,
    the oldest forgotten first), so a late retry is refused as expired instead of running
    twice. ``redact`` rewrites failed results' messages (server paths -> tinker:// paths).

    Failed results are also bounded in bytes: past ``max_failed_bytes`` (each counted as its
    body plus :attr:`RECORD_BYTES`) the oldest failed records go first, as if swept (anyone
    with a key can create failures as fast as they can send requests). ``pending(owner)``
    counts an owner's unfinished requests (the runtime's per-owner queue bound)."""

    #: what one record costs besides its result body (the record, its event, its dict entries)
    RECORD_BYTES = 1024

    def __init__(self, loop: asyncio.AbstractEventLoop, retention_s: float = 900.0,
                 unretrieved_retention_s: float = 6 * 3600.0, redact: Callable[[str], str] | None = None,
                 expired_horizon_s: float = 24 * 3600.0, max_expired: int = 100_000,
                 max_failed_bytes: int = 64 * 2**20) -> None:
        self.loop = loop
        self.max_failed_bytes = max_failed_bytes
        #: failed request id -> bytes counted for it, oldest first
        self._failed: dict[str, int] = {}
        self._failed_bytes = 0
        self._pending: collections.Counter[str] = collections.Counter()
        self.retention_s = retention_s
        self.unretrieved_retention_s = unretrieved_retention_s
        self.redact = redact
        self.expired_horizon_s = expired_horizon_s
        self.max_expired = max_expired
        self._records: dict[str, FutureRecord] = {}
        self._dedup: dict[tuple, str] = {}
        #: swept de-duplication key -> when (monotonic), oldest first
        self._expired: dict[tuple, float] = {}
        self._last_sweep = time.monotonic()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def failed_bytes(self) -> int:
        """The bytes counted for the failed results kept (bounded by ``max_failed_bytes``)."""
        return self._failed_bytes

    @property
    def expired_keys(self) -> int:
        """How many swept de-duplication keys are remembered (bounded by ``max_expired``)."""
        return len(self._expired)

    def unfinished_by_owner(self) -> dict[str, int]:
        """Owner -> requests accepted and not finished yet (queued or running; the console)."""
        return dict(collections.Counter(r.owner for r in self._records.values() if r.result is None))

    def lookup(self, dedup_key: tuple | None) -> FutureRecord | None:
        """The record of an earlier submission with the same key (a retry), if any; InputError
        when that submission ran but its record has expired."""
        if dedup_key is None:
            return None
        if dedup_key in self._expired:
            raise InputError(
                f"this request was already submitted and ran, and its result has expired (results are kept "
                f"{self.retention_s:.0f} s after retrieval); not running it again: {_describe(dedup_key)}"
            )
        rid = self._dedup.get(dedup_key)
        return self._records.get(rid) if rid is not None else None

    def create(self, owner: str, model_id: str | None, dedup_key: tuple | None = None,
               prefix: str = "req") -> FutureRecord:
        self._maybe_sweep()
        rid = f"{prefix}-{uuid.uuid4().hex}"
        rec = FutureRecord(rid, owner, model_id, time.time(), asyncio.Event(), dedup_key=dedup_key)
        self._records[rid] = rec
        self._pending[owner] += 1
        if dedup_key is not None:
            self._dedup[dedup_key] = rid
        return rec

    def failed(self, owner: str, exc: BaseException, prefix: str = "req", model_id: str | None = None
               ) -> FutureRecord:
        """A new record, already failed with ``exc`` (a request that never reached a model)."""
        rec = self.create(owner, model_id, prefix=prefix)
        self.finish(rec, Result.from_exception(exc))
        return rec

    def completer(self, rec: FutureRecord) -> Callable[[Result], None]:
        """A thread-safe callback that finishes ``rec``."""

        def done(result: Result) -> None:
            try:
                self.loop.call_soon_threadsafe(self.finish, rec, result)
            except RuntimeError:  # the loop is closed: the server has shut down
                pass

        return done

    def finish(self, rec: FutureRecord, result: Result) -> None:
        """Finish from the event loop thread (the first result wins)."""
        if rec.result is not None:
            return
        if result.failed and self.redact is not None:
            doc = json.loads(result.body)
            doc["error"] = self.redact(doc["error"])
            result = Result.error(doc["error"], doc["category"])
        rec.result = result
        rec.event.set()
        self._pending[rec.owner] -= 1
        if self._pending[rec.owner] <= 0:
            del self._pending[rec.owner]
        if result.failed:
            self._failed[rec.request_id] = size = len(result.body) + self.RECORD_BYTES
            self._failed_bytes += size
            now = time.monotonic()
            while self._failed_bytes > self.max_failed_bytes and self._failed:
                self._drop(next(iter(self._failed)), now)

    def fail_unfinished(self, message: str) -> None:
        """(shutdown) Finish every unfinished record with a server error, waking its long-polls."""
        for rec in [r for r in self._records.values() if r.result is None]:
            self.finish(rec, Result.error(message, "server"))

    def pending(self, owner: str) -> int:
        """``owner``'s requests accepted and not finished (queued, waiting for a seq_id, or running)."""
        return self._pending.get(owner, 0)

    async def wait(self, owner: str, request_id: str, timeout: float, ended: asyncio.Event | None = None
                   ) -> tuple[FutureRecord | None, Result | None]:
        """(record, result): record None for an unknown id (or another owner's); result None
        means still running after ``timeout`` seconds (or when ``ended`` was set first)."""
        rec = self._records.get(request_id)
        if rec is None or rec.owner != owner:
            return None, None
        if rec.result is None:
            waits = {asyncio.ensure_future(rec.event.wait())}
            if ended is not None:
                waits.add(asyncio.ensure_future(ended.wait()))
            try:
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waited in waits:
                    waited.cancel()
            if rec.result is None:
                return rec, None
        rec.retrieved_at = time.time()
        return rec, rec.result

    def _maybe_sweep(self) -> None:
        if time.monotonic() - self._last_sweep >= 60:
            self.sweep()

    def sweep(self) -> None:
        """Drop the results kept past their retention and the remembered keys past the horizon
        or the cap (at most once a minute on its own; a test or an operator may call it now)."""
        now = self._last_sweep = time.monotonic()
        wall = time.time()
        dead = [
            rid for rid, r in self._records.items()
            if r.result is not None and (
                (r.retrieved_at is not None and wall - r.retrieved_at > self.retention_s)
                or wall - r.created_at > self.unretrieved_retention_s
            )
        ]
        for rid in dead:
            self._drop(rid, now)
        # forget the oldest swept keys: past the horizon, or beyond the cap
        while self._expired:
            key, when = next(iter(self._expired.items()))
            if now - when <= self.expired_horizon_s and len(self._expired) <= self.max_expired:
                break
            del self._expired[key]

    def _drop(self, rid: str, now: float) -> None:
        """Forget a finished record; its de-duplication key is remembered as expired."""
        rec = self._records.pop(rid, None)
        self._failed_bytes -= self._failed.pop(rid, 0)
        if rec is not None and rec.dedup_key is not None and self._dedup.get(rec.dedup_key) == rid:
            del self._dedup[rec.dedup_key]
            self._expired.pop(rec.dedup_key, None)
            self._expired[rec.dedup_key] = now


def _describe(dedup_key: tuple) -> str:
    """A de-duplication key in words, e.g. ``model sess-1:train:0 seq_id 4`` (the owner left out)."""
    return " ".join(str(part) for part in dedup_key[1:])
