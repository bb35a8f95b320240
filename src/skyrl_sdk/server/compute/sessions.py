"""Client sessions: who owns them, whether they are alive, their expiry, and the training
models they own (:class:`TrainingModel`, shared by the runtime and the sampler).

A session is alive while its client shows signs of life (a heartbeat, any request on its
models or sampling sessions, polling their futures) or one of its models is busy. One
without either for ``session_timeout_s`` is finished as expired and ``on_end`` frees its
models; later requests on it say it expired.

Liveness lives in memory, on the event loop; the records (create, heartbeat, finish, reads)
are written and read on a thread: the store's lock may be held by a save on the compute thread
through a file sync, and no other client's request may wait for that.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ...errors import InputError, NotFoundError, quoted
from ...types import LoraConfig
from ..config import ServerConfig
from ..state.store import Store
from ..wire import caps, envelopes
from .executor import Queue
from .futures import Sequencer
from .snapshots import WeightsSnapshot

if TYPE_CHECKING:
    from ...backend import Backend

logger = logging.getLogger(__name__)

EXPIRED = "expired"


class Sessions:
    def __init__(self, config: ServerConfig, store: Store, loop: asyncio.AbstractEventLoop,
                 on_end: Callable[[str, str], None], busy: Callable[[str], bool]) -> None:
        self.config = config
        self.store = store
        self.loop = loop
        self.on_end = on_end
        self.busy = busy
        self._last_seen: dict[str, float] = {}  # session id -> monotonic time of its last sign of life
        self._owners: dict[str, str] = {}  # open session id -> its owner (caps.check_open_sessions)
        self._reaper: asyncio.TimerHandle | None = None
        self._expiring: set[asyncio.Task] = set()
        self._schedule_reap()

    async def create(self, owner: str, body: dict) -> str:
        tags, metadata, sdk = caps.tags(body.get("tags")), caps.metadata(body.get("user_metadata")), \
            body.get("sdk_version")
        name = caps.display_name(body.get("display_name"))
        caps.check_open_sessions(sum(o == owner for o in self._owners.values()), self.config.max_sessions_per_owner)
        sid = f"sess-{uuid.uuid4().hex[:16]}"
        self._owners[sid] = owner  # counted now: a create arriving while this one writes sees it
        try:
            await asyncio.to_thread(self.store.add_session, sid, owner, tags, metadata,
                                    sdk[:100] if isinstance(sdk, str) else None, name)
        except BaseException:
            self._owners.pop(sid, None)
            raise
        self._last_seen[sid] = time.monotonic()
        return sid

    async def open(self, owner: str, session_id: str) -> dict:
        """``owner``'s live session (refreshing its liveness): unknown, finished or expired -> error."""
        row = await asyncio.to_thread(self.store.session, session_id, owner)
        if row is None:
            raise NotFoundError(f"unknown session {quoted(session_id)}")
        if row["finished_at"] is not None:
            if row["finish_reason"] == f'"{EXPIRED}"':
                raise InputError(f"session {session_id} expired: no heartbeat for {self.config.session_timeout_s:g} s "
                                 f"(--session-timeout), so its models were freed; create a new ServiceClient")
            raise InputError(f"session {session_id} was finished; create a new ServiceClient")
        self.seen(session_id)
        self._owners[session_id] = owner
        return row

    async def check_open(self, owner: str, session_id: str) -> None:
        """InputError unless ``owner``'s session ``session_id`` is open (neither finished nor
        expired); from memory when this process opened it, else from its record (on a thread)."""
        if self._owners.get(session_id) != owner:
            await self.open(owner, session_id)

    def seen(self, session_id: str, at: float | None = None) -> None:
        """A sign of life from ``session_id``'s client, at ``at`` (``time.monotonic()``; default now)."""
        self._last_seen[session_id] = time.monotonic() if at is None else at

    def silent_for(self, session_id: str) -> float | None:
        """Seconds since the last sign of life of an open session's client (None: not open)."""
        seen = self._last_seen.get(session_id)
        return None if seen is None else time.monotonic() - seen

    async def heartbeat(self, owner: str, body: dict) -> str | None:
        """Record a heartbeat; for a finished or expired session, the message saying so
        (answered 410, on which the tinker client stops its heartbeat loop)."""
        session_id = envelopes.session_id(body)
        try:
            await self.open(owner, session_id)
        except NotFoundError:
            raise
        except InputError as exc:
            return str(exc)
        await asyncio.to_thread(self.store.heartbeat, session_id, owner)
        return None

    async def finish(self, owner: str, session_id: str, reason: Any) -> None:
        if await asyncio.to_thread(self.store.session, session_id, owner) is None:
            raise NotFoundError(f"unknown session {quoted(session_id)}")
        await self._end(session_id, reason, "its session finished")

    async def _end(self, session_id: str, reason: Any, why: str) -> None:
        """Record the session finished (on a thread), then forget it and free its models."""
        await asyncio.to_thread(self.store.finish_session, session_id, reason)
        self._last_seen.pop(session_id, None)
        self._owners.pop(session_id, None)
        self.on_end(session_id, why)

    def _schedule_reap(self) -> None:
        period = max(0.05, min(self.config.session_timeout_s / 4, 15.0))
        self._reaper = self.loop.call_later(period, self._timer)

    def _timer(self) -> None:
        self.reap()
        if self._reaper is not None:  # not stopped
            self._schedule_reap()

    def reap(self) -> None:
        """(event loop; a timer calls it every quarter timeout) Finish the sessions with no sign of
        life for ``session_timeout_s``: their records are written by a task, on a thread."""
        now = time.monotonic()
        timeout = self.config.session_timeout_s
        expired = []
        for sid, seen in list(self._last_seen.items()):
            if now - seen > timeout and not self.busy(sid):
                logger.info("session %s expired (no heartbeat for %.0f s); freeing its models", sid, now - seen)
                self._last_seen.pop(sid, None)  # reaped once, even while its record is being written
                expired.append(sid)
        if expired:
            task = self.loop.create_task(self._expire(expired, f"its session expired (no heartbeat for {timeout:g} s)"))
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    async def _expire(self, session_ids: list[str], why: str) -> None:
        for sid in session_ids:
            try:
                await self._end(sid, EXPIRED, why)
            except Exception:  # pragma: no cover - a full disk: the next start finds it unfinished
                logger.exception("session %s: recording its expiry failed", sid)

    def stop(self) -> None:
        """(event loop) Stop reaping (server shutdown)."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def list(self, owner: str, limit: int, offset: int) -> dict:
        rows, _ = await asyncio.to_thread(self.store.list_sessions, owner, limit, offset)
        return {"sessions": [r["session_id"] for r in rows]}

    async def get(self, owner: str, session_id: str) -> dict:
        return await asyncio.to_thread(self._get, owner, session_id)

    def _get(self, owner: str, session_id: str) -> dict:
        row = self.store.session(session_id, owner)
        if row is None:
            raise NotFoundError(f"unknown session {quoted(session_id)}")
        return envelopes.session_json(row, self.store.run_ids_of_session(session_id, owner))


@attrs.define(eq=False)
class TrainingModel:
    """A client's training model: its Backend (built on its queue's executor), the order its
    requests run in, and the pinned weights its sampling sessions read."""

    model_id: str
    owner: str
    session_id: str
    base_model: str
    lora: LoraConfig | None
    #: the model's queue on the compute executor
    worker: Queue
    sequencer: Sequencer
    ready: asyncio.Event
    backend: Any = None
    error: str | None = None
    #: weights versions (``weights_version``) that snapshot sampling sessions pin
    pinned: set = attrs.Factory(set)
    #: pinned version -> its snapshot (in memory, or a scratch directory)
    snapshots: collections.OrderedDict[int, WeightsSnapshot | Path] = attrs.Factory(collections.OrderedDict)
    dropped: set = attrs.Factory(set)
    #: why the model was released (None while it is live)
    closed: str | None = None

    @property
    def weights_version(self) -> int:
        """Its engine's weights version (``Engine.weights_version``, the one count: it moves on
        every ``optim_step`` that changed the weights and every ``load_weights``)."""
        return self.require_backend().weights_version

    def require_backend(self) -> Backend:
        if self.closed:
            raise InputError(f"model {self.model_id} was released: {self.closed}")
        if self.backend is None:
            raise InputError(f"model {self.model_id} could not be created: {self.error or 'unknown error'}")
        return self.backend
