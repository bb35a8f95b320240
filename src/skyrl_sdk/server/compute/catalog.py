"""The catalog: an owner's training runs, checkpoints and metric curves, read by the catalog
routes (Tinker's ``RestClient``, tinker-cookbook's resume and rolling saves) and by the
console, and what an owner may change about a checkpoint (delete, publish, time to live),
through this one service.

Another owner's run reads as unknown (404). Publishing, as Tinker defines it: only the
training run's owner publishes or unpublishes; while published, any owner of this server may
*read* the checkpoint by its ``tinker://`` path (sample from it, load it, its weights info),
never list, change or delete it. Every read and write of the store, file work (deleting a
checkpoint's directory) and the metric history's reads run off the event loop: the store's lock
may be held by a save on the compute thread through a file sync, and no other client's request
may wait for that.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import NotFoundError, quoted
from ..state import session_search
from ..state.history import History
from ..state.store import Store
from ..wire import envelopes
from ..wire.session_query import SessionSearch
from ..wire.tinker_paths import TinkerPath, iso
from .exports import LinkTarget, public_files
from .sessions import TrainingModel

#: a model whose worker had work within this many seconds is "live", else "idle"
LIVE_S = 30.0
#: a model whose client showed no sign of life (a heartbeat every 10 s, any request) for this
#: long is "gone": its script ended without close(); its models are freed at --session-timeout
CLIENT_GONE_S = 30.0


def on_a_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    """The public, awaitable form of a catalog method that touches the store: it runs on a thread."""
    @functools.wraps(method)
    async def off_loop(self: Catalog, *args: Any) -> Any:
        return await asyncio.to_thread(method, self, *args)
    return off_loop


class Catalog:
    """Runs and checkpoints of each owner (see the module docstring). ``models`` is the
    runtime's live training models by id; ``sampling_sessions`` lists the sampling sessions
    of this process as ``(session id, run id)`` pairs; ``silent_for(session id)`` is how long
    a session's client has shown no sign of life (None: not open)."""

    def __init__(self, store: Store, history: History, models: Mapping[str, TrainingModel],
                 sampling_sessions: Callable[[], list[tuple[str, str]]],
                 silent_for: Callable[[str], float | None] = lambda session_id: None) -> None:
        self.store = store
        self.history = history
        self.models = models
        self.sampling_sessions = sampling_sessions
        self.silent_for = silent_for

    # ---- Tinker's catalog routes ------------------------------------------------------------------
    def _run(self, owner: str, run_id: Any) -> dict[str, Any]:
        """``owner``'s training run record, or NotFoundError."""
        run = self.store.run(run_id, owner) if isinstance(run_id, str) else None
        if run is None:
            raise NotFoundError(f"unknown training run {quoted(run_id)}")
        return run

    run = on_a_thread(_run)

    def _training_run(self, owner: str, run_id: Any) -> dict[str, Any]:
        """Tinker's ``TrainingRun`` JSON."""
        run = self._run(owner, run_id)
        return envelopes.run_json(run, self.store.last_checkpoint(run["run_id"], "training"),
                             self.store.last_checkpoint(run["run_id"], "sampler"))

    training_run = on_a_thread(_training_run)

    @on_a_thread
    def training_runs(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        runs, total = self.store.list_runs(owner, limit, offset)
        return {"training_runs": [self._training_run(owner, r["run_id"]) for r in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @on_a_thread
    def checkpoints(self, owner: str, run_id: str | None, limit: int = 10**9, offset: int = 0) -> dict[str, Any]:
        """One run's checkpoints (all of them), or a page of all the owner's."""
        if run_id is not None:
            self._run(owner, run_id)
            return {"checkpoints": self.store.list_checkpoints(owner, run_id)[0], "cursor": None}
        checkpoints, total = self.store.list_checkpoints(owner, None, limit, offset)
        return {"checkpoints": checkpoints, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @on_a_thread
    def delete_checkpoint(self, owner: str, run_id: str, checkpoint_id: str) -> None:
        """Delete an owned checkpoint's record and files."""
        tp = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}")
        if self.store.run(tp.run_id, owner) is None or not self.store.delete_checkpoint(tp):
            raise NotFoundError(f"no checkpoint {tp} on this server")

    @on_a_thread
    def weights_info(self, owner: str, tinker_path: Any) -> dict[str, Any]:
        """The weights info of the caller's checkpoint, or of another owner's published one."""
        tp, _ = self.store.resolve_checkpoint(tinker_path, owner, readable=True)
        run = self.store.run(tp.run_id, None)
        if run is None:
            raise NotFoundError(f"no checkpoint {tp} on this server (its training run is gone)")
        return envelopes.weights_info_json(run)

    @on_a_thread
    def export_target(self, owner: str, tinker_path: Any) -> LinkTarget:
        """What a download link to one of ``owner``'s own exports names (never another owner's)."""
        tp, directory = self.store.resolve_checkpoint(tinker_path, owner, kind="external")
        record = self.store.checkpoint(tp, owner)
        if record is None:  # deleted or expired since it resolved
            raise NotFoundError(f"no checkpoint {tp} on this server")
        return LinkTarget(owner, str(tp), record["time"], directory, tuple(public_files(directory)))

    def link_record(self, owner: str, tinker_path: str) -> dict[str, Any] | None:
        """(off the event loop) The catalog record a download link's checkpoint has now: ``owner``'s
        live export, None once it is deleted or expired."""
        return self.store.checkpoint(TinkerPath.parse(tinker_path), owner)

    def _owned_checkpoint(self, owner: str, run_id: str, checkpoint_id: str) -> TinkerPath:
        """``owner``'s live checkpoint ``<run_id>/<checkpoint_id>``; 404 for another owner's (published or not)."""
        tp = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}")
        if self.store.run(tp.run_id, owner) is None or self.store.checkpoint(tp, owner) is None:
            raise NotFoundError(f"no checkpoint {tp} of yours on this server")
        return tp

    @on_a_thread
    def publish(self, owner: str, run_id: str, checkpoint_id: str, public: bool) -> None:
        self.store.update_checkpoint(self._owned_checkpoint(owner, run_id, checkpoint_id), public=public)

    @on_a_thread
    def set_ttl(self, owner: str, run_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """Expire the checkpoint ``ttl_seconds`` from now (checked by ``envelopes.ttl_seconds``), or never (None)."""
        tp = self._owned_checkpoint(owner, run_id, checkpoint_id)
        self.store.update_checkpoint(tp, expires_at=None if ttl_seconds is None else time.time() + ttl_seconds)

    @on_a_thread
    def search_sessions(self, owner: str, search: SessionSearch) -> dict[str, Any]:
        return session_search.search_sessions(self.store, owner, search)

    # ---- the console ------------------------------------------------------------------------------
    def status(self, run_id: str) -> str:
        """live (in memory, work within LIVE_S), idle (in memory, none since), gone (in memory, but
        its client has shown no sign of life for CLIENT_GONE_S: the script ended without close();
        freed at the session timeout), freed (not in memory: released, its session ended,
        creation failed, or the server restarted)."""
        model = self.models.get(run_id)
        if model is None or model.closed or model.error is not None:
            return "freed"
        idle = model.worker.idle_for()
        silent = self.silent_for(model.session_id)
        if idle > 0 and silent is not None and silent >= CLIENT_GONE_S:
            return "gone"
        return "live" if idle < LIVE_S else "idle"

    def _sessions_by_run(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = collections.defaultdict(list)
        for sid, run_id in self.sampling_sessions():
            out[run_id].append(sid)
        return out

    def _console_run(self, run: dict[str, Any], summary: dict[str, Any], sessions: list[str]) -> dict[str, Any]:
        lora = run["lora"]
        model = self.models.get(run["run_id"])
        silent = self.silent_for(model.session_id) if model is not None else None
        return {"model_id": run["run_id"], "base_model": run["base_model"],
                "lora_rank": lora["rank"] if lora else None, "session_id": run["session_id"],
                "created": iso(run["created_at"]), "last_request": iso(run["last_request_time"]),
                "status": self.status(run["run_id"]), "steps": summary["steps"], "last": summary["last"],
                "client_silent_s": round(silent, 1) if silent is not None else None,
                "sampling_sessions": len(sessions)}

    async def console_runs(self, owner: str, limit: int, offset: int) -> dict[str, Any]:
        rows, total = await asyncio.to_thread(self.store.list_runs, owner, limit, offset)
        summaries = await self.history.summaries_off_loop([r["run_id"] for r in rows])
        sessions = self._sessions_by_run()
        return {"runs": [self._console_run(r, summaries[r["run_id"]], sessions.get(r["run_id"], [])) for r in rows],
                "total": total, "limit": limit, "offset": offset}

    async def console_run(self, owner: str, run_id: str) -> dict[str, Any]:
        run, checkpoints = await self._run_and_checkpoints(owner, run_id)
        summary = (await self.history.summaries_off_loop([run_id]))[run_id]
        sessions = self._sessions_by_run().get(run_id, [])
        return {**self._console_run(run, summary, sessions), "sampling_session_ids": sorted(sessions)[-50:],
                "checkpoints": checkpoints}

    @on_a_thread
    def _run_and_checkpoints(self, owner: str, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self._run(owner, run_id), self.store.list_checkpoints(owner, run_id)[0]

    def history_dropped(self) -> int:
        """Metric points the history dropped (its writer fell behind): the operators' view shows it."""
        return self.history.dropped

    async def curves_body(self, owner: str, run_id: str, points: int) -> bytes:
        """One run's curves as JSON bytes, computed on the history's reader thread (shared by
        identical concurrent requests, cached per step count)."""
        await self.run(owner, run_id)
        return await self.history.curves_body(run_id, points)
