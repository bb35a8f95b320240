"""Durable records under ``--state-dir``: sessions, training runs, checkpoints (SQLite).

Checkpoints are directories under ``<state-dir>/runs/<run dir>/<kind>/<name>``. Every path
handed out is built here from validated parts and checked to lie inside the state dir, so
neither a checkpoint name nor a ``tinker://`` path can point anywhere else.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import InputError, NotFoundError
from ...models.checkpoint import clean_interrupted_saves, protect_directory
from ..config import DEFAULT_OWNER
from ..wire.tinker_paths import KIND_TO_SEGMENT, NAME_RE, SEGMENT_TO_KIND, TinkerPath, check_name, check_run_id, iso
from .reconcile import reconcile_checkpoints
from .statedir import StateDirLock

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL DEFAULT 'default',
    created_at REAL NOT NULL,
    last_heartbeat REAL,
    finished_at REAL,
    finish_reason TEXT,
    tags TEXT,
    user_metadata TEXT,
    sdk_version TEXT,
    display_name TEXT
);
CREATE TABLE IF NOT EXISTS training_runs (
    run_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL DEFAULT 'default',
    session_id TEXT,
    base_model TEXT NOT NULL,
    lora TEXT,
    user_metadata TEXT,
    created_at REAL NOT NULL,
    last_request_time REAL NOT NULL,
    dirname TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    size_bytes INTEGER,
    expires_at REAL,
    user_metadata TEXT,
    public INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, kind, name)
);
CREATE TABLE IF NOT EXISTS sampling_sessions (
    sampling_session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL DEFAULT 'default',
    session_id TEXT,
    base_model TEXT NOT NULL,
    model_path TEXT,
    created_at REAL NOT NULL
);
"""
#: tables that gained an ``owner`` column (a state dir from before owners: all 'default')
_OWNED_TABLES = ("sessions", "training_runs", "sampling_sessions")
#: columns added since (table, column, declaration): a state dir from before gets them
_ADDED_COLUMNS = (("sessions", "display_name", "TEXT"), ("checkpoints", "public", "INTEGER NOT NULL DEFAULT 0"))
#: a checkpoint whose ttl ran out is gone at once (its files are deleted by the next sweep)
_LIVE = "(c.expires_at IS NULL OR c.expires_at > ?)"


def _dumps(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    """SQLite records + checkpoint directories. Thread-safe (one connection, one lock)."""

    #: a run's last request time is written at most this often (each write is a WAL sync, and
    #: every training request touches its run); the latest lives in memory, where ``run`` reads it
    TOUCH_INTERVAL_S = 5.0

    def __init__(self, state_dir: Path, lock: StateDirLock | None = None) -> None:
        self.root = Path(state_dir).expanduser().resolve()
        #: the state dir is this server's alone while it runs (statedir.py); released at close
        self.lock = lock if lock is not None and lock.held else StateDirLock.acquire(self.root)
        try:
            self._path_re = re.compile(re.escape(str(self.root)) + r"(/[^\s'\"]*)?")
            (self.root / "runs").mkdir(exist_ok=True)
            self._lock = threading.RLock()
            #: run id -> (last request time, the one last written)
            self._touched: dict[str, tuple[float, float]] = {}
            #: run directory name -> run id, of every run: what :meth:`redact` reads, with no disk read
            self._run_ids: dict[str, str] = {}
            self._db = sqlite3.connect(str(self.root / "server.sqlite3"), check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.executescript(_SCHEMA)
                for table in _OWNED_TABLES:
                    columns = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
                    if "owner" not in columns:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL "
                                         f"DEFAULT '{DEFAULT_OWNER}'")
                for table, column, declaration in _ADDED_COLUMNS:
                    if column not in {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
                self._run_ids = {r["dirname"]: r["run_id"]
                                 for r in self._db.execute("SELECT dirname, run_id FROM training_runs")}
        except BaseException:
            self.lock.release()
            raise

    def tidy(self) -> None:
        """(start-up) Saves interrupted by a crash leave temp/.old directories: remove them (only
        our own names, of dead processes); let no save ever replace the state dir or a parent;
        finish deletes a crash cut short; empty ``scratch/`` (a process's working files; the state
        dir is this process's alone now); delete expired checkpoints; reconcile directories that
        have no record."""
        if (leftovers := clean_interrupted_saves(self.root, recursive=True)):
            logger.info("removed %d leftovers of interrupted saves", len(leftovers))
        protect_directory(self.root)
        if (n := self._finish_deletes()):
            logger.warning("finished %d checkpoint deletes a crash had cut short", n)
        if (self.root / "scratch").exists():
            shutil.rmtree(self.root / "scratch", ignore_errors=True)
        if (n := self.delete_expired()):
            logger.info("deleted %d expired checkpoints", n)
        self.reconcile_checkpoints()

    def redact(self, message: str) -> str:
        """``message`` with paths under the state dir shown as ``tinker://`` paths (or ``<state-dir>``).
        It reads nothing from disk (the event loop calls it on every error it answers)."""

        def shown(match: re.Match) -> str:
            parts = (match.group(1) or "").strip("/").split("/")
            if len(parts) >= 4 and parts[0] == "runs" and parts[2] in SEGMENT_TO_KIND:
                run_id = self.run_id_of_dirname(parts[1])
                if run_id is not None:
                    return f"tinker://{run_id}/{parts[2]}/{'/'.join(parts[3:])}"
            return "<state-dir>" + ("/..." if match.group(1) else "")

        return self._path_re.sub(shown, message)

    def close(self) -> None:
        with self._lock:
            try:
                for run_id, (last, written) in self._touched.items():
                    if last > written:
                        self._write_touch(run_id, last)
                self._db.close()
            finally:
                self.lock.release()

    def _exec(self, sql: str, params: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, params)

    def _rows(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # ---- paths ------------------------------------------------------------------------
    def inside(self, path: Path) -> Path:
        """``path`` resolved, or an error if it is not strictly inside the state dir."""
        resolved = Path(path).resolve()
        if resolved == self.root or self.root not in resolved.parents:
            raise InputError(f"refusing a path outside the server's state dir: {path}")
        return resolved

    def scratch_dir(self, *parts: str) -> Path:
        """A server-owned directory (ephemeral snapshots, ...) under the state dir."""
        for p in parts:
            check_name(p, "directory name")
        return self.inside(self.root.joinpath("scratch", *parts))

    @staticmethod
    def run_dirname(run_id: str) -> str:
        return "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:20]

    def checkpoint_dir(self, tp: TinkerPath) -> Path:
        return self.inside(self.root / "runs" / self.run_dirname(tp.run_id) / KIND_TO_SEGMENT[tp.kind] / tp.name)

    # ---- sessions ---------------------------------------------------------------------
    def add_session(self, session_id: str, owner: str, tags: Any, user_metadata: Any, sdk_version: Any,
                    display_name: str | None = None) -> None:
        self._exec(
            "INSERT OR IGNORE INTO sessions (session_id, owner, created_at, last_heartbeat, tags, user_metadata,"
            " sdk_version, display_name) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (session_id, owner, time.time(), time.time(), _dumps(tags), _dumps(user_metadata), sdk_version,
             display_name),
        )

    def session(self, session_id: str, owner: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM sessions WHERE session_id = ? AND owner = ?", (session_id, owner))
        return dict(rows[0]) if rows else None

    def heartbeat(self, session_id: str, owner: str) -> bool:
        return self._exec("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ? AND owner = ?",
                          (time.time(), session_id, owner)).rowcount > 0

    def finish_session(self, session_id: str, reason: Any) -> None:
        self._exec(
            "UPDATE sessions SET finished_at = COALESCE(finished_at, ?), finish_reason = COALESCE(finish_reason, ?)"
            " WHERE session_id = ?",
            (time.time(), _dumps(reason), session_id),
        )

    def list_sessions(self, owner: str, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        rows = self._rows("SELECT * FROM sessions WHERE owner = ? ORDER BY created_at DESC LIMIT ? OFFSET ?",
                          (owner, limit, offset))
        total = self._rows("SELECT COUNT(*) AS n FROM sessions WHERE owner = ?", (owner,))[0]["n"]
        return [dict(r) for r in rows], total

    # ---- training runs ----------------------------------------------------------------
    def add_run(self, run_id: str, owner: str, session_id: str | None, base_model: str, lora: dict | None,
                user_metadata: Any) -> None:
        now = time.time()
        self._exec(
            "INSERT OR REPLACE INTO training_runs (run_id, owner, session_id, base_model, lora, user_metadata,"
            " created_at, last_request_time, dirname) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (check_run_id(run_id), owner, session_id, base_model, _dumps(lora), _dumps(user_metadata), now, now,
             self.run_dirname(run_id)),
        )
        self._run_ids[self.run_dirname(run_id)] = run_id

    def touch_run(self, run_id: str) -> None:
        """A request on the run now (the runtime calls it on a thread and never waits: it never
        raises; a write that fails is logged, the time kept in memory)."""
        now = time.time()
        with self._lock:
            written = self._touched.get(run_id, (0.0, 0.0))[1]
            if now - written >= self.TOUCH_INTERVAL_S:
                try:
                    self._write_touch(run_id, now)
                    written = now
                except sqlite3.Error:
                    logger.exception("recording the last request time of %s failed", run_id)
            self._touched[run_id] = (now, written)

    def _write_touch(self, run_id: str, when: float) -> None:
        self._exec("UPDATE training_runs SET last_request_time = ? WHERE run_id = ?", (when, run_id))

    def run(self, run_id: str, owner: str | None) -> dict[str, Any] | None:
        """The training run ``run_id`` if ``owner`` owns it (None: whoever owns it; only for the
        run of a checkpoint the caller may read, see ``resolve_checkpoint(readable=True)``)."""
        rows = self._rows("SELECT * FROM training_runs WHERE run_id = ? AND (owner = ? OR ? IS NULL)",
                          (run_id, owner, owner))
        if not rows:
            return None
        out = dict(rows[0])
        out["last_request_time"] = max(out["last_request_time"], self._touched.get(run_id, (0.0, 0.0))[0])
        out["lora"] = _loads(out["lora"])
        out["user_metadata"] = _loads(out["user_metadata"])
        return out

    def run_id_of_dirname(self, dirname: str) -> str | None:
        return self._run_ids.get(dirname)

    def list_runs(self, owner: str, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        rows = self._rows("SELECT run_id FROM training_runs WHERE owner = ? ORDER BY created_at DESC LIMIT ? OFFSET ?",
                          (owner, limit, offset))
        total = self._rows("SELECT COUNT(*) AS n FROM training_runs WHERE owner = ?", (owner,))[0]["n"]
        return [run for r in rows if (run := self.run(r["run_id"], owner)) is not None], total

    def run_ids_of_session(self, session_id: str, owner: str) -> list[str]:
        rows = self._rows("SELECT run_id FROM training_runs WHERE session_id = ? AND owner = ? ORDER BY created_at",
                          (session_id, owner))
        return [r["run_id"] for r in rows]

    # ---- checkpoints (owned through their training run) -------------------------------
    def add_checkpoint(self, tp: TinkerPath, ttl_seconds: Any = None, user_metadata: Any = None,
                       created_at: float | None = None) -> None:
        now = time.time() if created_at is None else created_at
        directory = self.checkpoint_dir(tp)
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) if directory.exists() else None
        expires = now + float(ttl_seconds) if isinstance(ttl_seconds, (int, float)) and ttl_seconds else None
        self._exec(
            "INSERT OR REPLACE INTO checkpoints (run_id, kind, name, created_at, size_bytes, expires_at, user_metadata)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (tp.run_id, tp.kind, tp.name, now, size, expires, _dumps(user_metadata)),
        )

    def update_checkpoint(self, tp: TinkerPath, **fields: Any) -> None:
        """Set ``public`` and/or ``expires_at`` of checkpoint ``tp``'s record."""
        unknown = set(fields) - {"public", "expires_at"}
        if unknown:
            raise ValueError(f"update_checkpoint: unknown fields {sorted(unknown)}")
        values = {k: int(v) if k == "public" else v for k, v in fields.items()}
        assignments = ", ".join(f"{k} = ?" for k in values)
        self._exec(f"UPDATE checkpoints SET {assignments} WHERE run_id = ? AND kind = ? AND name = ?",
                   (*values.values(), tp.run_id, tp.kind, tp.name))

    def save_recorded(self, tp: TinkerPath, write: Callable[[Path], Any], ttl_seconds: Any = None,
                      user_metadata: Any = None) -> None:
        """A save of ``tp``: ``write(directory)``, then its record. When the record cannot be
        written (a full or read-only disk, a locked database), a directory this save created is
        removed again: no unrecorded checkpoint is left for a retry to trip over ("already
        exists") or the next start to adopt, after the client was told the save failed."""
        directory = self.checkpoint_dir(tp)
        existed = directory.exists()
        write(directory)
        try:
            self.add_checkpoint(tp, ttl_seconds, user_metadata)
        except BaseException:
            if not existed:
                shutil.rmtree(directory, ignore_errors=True)
            raise

    def checkpoint(self, tp: TinkerPath, owner: str, readable: bool = False) -> dict[str, Any] | None:
        """``owner``'s live checkpoint ``tp``; with ``readable``, another owner's published one too."""
        rows = self._rows(
            "SELECT c.* FROM checkpoints c JOIN training_runs r ON r.run_id = c.run_id"
            f" WHERE c.run_id = ? AND c.kind = ? AND c.name = ? AND (r.owner = ? OR (? AND c.public)) AND {_LIVE}",
            (tp.run_id, tp.kind, tp.name, owner, readable, time.time()))
        return self._checkpoint_json(rows[0]) if rows else None

    def resolve_checkpoint(self, path: Any, owner: str, kind: str | None = None,
                           readable: bool = False) -> tuple[TinkerPath, Path]:
        """A recorded checkpoint's ``tinker://`` path -> its directory (which must exist); with
        ``readable``, another owner's published checkpoint resolves too (to read, never to change)."""
        tp = TinkerPath.parse(path)
        if kind is not None and tp.kind != kind:
            want = KIND_TO_SEGMENT[kind]
            raise InputError(f"{path}: expected a tinker://<run>/{want}/<name> path here")
        if self.checkpoint(tp, owner, readable) is None:
            raise NotFoundError(f"no checkpoint {path} on this server")
        directory = self.checkpoint_dir(tp)
        if not directory.is_dir():
            raise InputError(f"checkpoint {path} is recorded but its files are gone")
        return tp, directory

    def list_checkpoints(self, owner: str, run_id: str | None = None, limit: int = 10**9, offset: int = 0
                         ) -> tuple[list[dict[str, Any]], int]:
        where, params = f"WHERE r.owner = ? AND {_LIVE}", (owner, time.time(), *(() if run_id is None else (run_id,)))
        if run_id is not None:
            where += " AND c.run_id = ?"
        joined = f"FROM checkpoints c JOIN training_runs r ON r.run_id = c.run_id {where}"
        rows = self._rows(f"SELECT c.* {joined} ORDER BY c.created_at, c.name LIMIT ? OFFSET ?",
                          (*params, limit, offset))
        total = self._rows(f"SELECT COUNT(*) AS n {joined}", params)[0]["n"]
        return [self._checkpoint_json(r) for r in rows], total

    def last_checkpoint(self, run_id: str, kind: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM checkpoints c WHERE run_id = ? AND kind = ? AND " + _LIVE +
                          " ORDER BY created_at DESC LIMIT 1", (run_id, kind, time.time()))
        return self._checkpoint_json(rows[0]) if rows else None

    def delete_checkpoint(self, tp: TinkerPath) -> bool:
        """Delete a checkpoint's record and files (the caller checked who owns it), so that a
        crash at any moment leaves the whole checkpoint or none of it: its directory is first
        moved aside, in one rename (the moment it is gone), to
        ``scratch/deleted/<id>/<run dir>/<segment>/<name>``, then its record is deleted, then
        the files. A crash after the rename leaves the record and the moved directory, which
        names it: the next start deletes that record, then empties scratch (:meth:`tidy`).
        (Removing the files in place, record first, let a crash leave a half-removed directory
        that the next start adopted again.)"""
        directory = self.checkpoint_dir(tp)
        with self._lock:
            trash = None
            if directory.exists() or directory.is_symlink():
                trash = self.inside(self.root / "scratch" / "deleted" / uuid.uuid4().hex)
                moved = trash / directory.relative_to(self.root / "runs")
                moved.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.replace(directory, moved)
                except OSError:  # (another file system under the state dir) removed in place, record first
                    trash = directory
            found = self._exec("DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                               (tp.run_id, tp.kind, tp.name)).rowcount > 0
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
            found = True
        return found

    def _finish_deletes(self) -> int:
        """(start-up, before scratch is emptied) Delete the records of the checkpoints a crash
        left moved aside in ``scratch/deleted/`` (a delete cut after its rename); how many."""
        finished = 0
        for moved in sorted((self.root / "scratch" / "deleted").glob("*/*/*/*")):  # <id>/<run dir>/<segment>/<name>
            run_id, kind = self.run_id_of_dirname(moved.parent.parent.name), SEGMENT_TO_KIND.get(moved.parent.name)
            if run_id is not None and kind is not None:
                finished += self._exec("DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                                       (run_id, kind, moved.name)).rowcount
        return finished

    def reconcile_checkpoints(self) -> tuple[list[str], list[str]]:
        """(start-up) Adopt or quarantine checkpoint directories without a record (:mod:`.reconcile`).
        Returns (adopted tinker paths, quarantined directories relative to the state dir)."""
        rows = self._rows("SELECT run_id, kind, name FROM checkpoints")
        recorded = {(r["run_id"], r["kind"], r["name"]) for r in rows}

        def adopt(run_id: str, kind: str, name: str, mtime: float) -> str:
            tp = TinkerPath(run_id, kind, name)
            self.add_checkpoint(tp, created_at=mtime)
            return str(tp)

        return reconcile_checkpoints(self.root, SEGMENT_TO_KIND, NAME_RE, self.run_id_of_dirname, recorded, adopt)

    def delete_expired(self, now: float | None = None) -> int:
        """Delete checkpoints whose ``ttl_seconds`` ran out (records and files); returns how many."""
        rows = self._rows("SELECT run_id, kind, name FROM checkpoints WHERE expires_at IS NOT NULL AND expires_at <= ?",
                          (time.time() if now is None else now,))
        for r in rows:
            self.delete_checkpoint(TinkerPath(r["run_id"], r["kind"], r["name"]))
        return len(rows)

    @staticmethod
    def _checkpoint_json(row: sqlite3.Row) -> dict[str, Any]:
        tp = TinkerPath(row["run_id"], row["kind"], row["name"])
        return {
            "checkpoint_id": tp.checkpoint_id,
            "checkpoint_type": row["kind"],
            "time": iso(row["created_at"]),
            "tinker_path": str(tp),
            "size_bytes": row["size_bytes"],
            "public": bool(row["public"]),
            "user_metadata": _loads(row["user_metadata"]),
            "expires_at": iso(row["expires_at"]),
        }

    # ---- sampling sessions ------------------------------------------------------------
    def add_sampling_session(self, sid: str, owner: str, session_id: str | None, base_model: str,
                             model_path: str | None) -> None:
        self._exec(
            "INSERT OR REPLACE INTO sampling_sessions (sampling_session_id, owner, session_id, base_model, model_path,"
            " created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (sid, owner, session_id, base_model, model_path, time.time()),
        )

    def sampling_session(self, sid: str, owner: str) -> dict[str, Any] | None:
        rows = self._rows("SELECT * FROM sampling_sessions WHERE sampling_session_id = ? AND owner = ?", (sid, owner))
        return dict(rows[0]) if rows else None
