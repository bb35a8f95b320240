"""The state dir belongs to one server at a time, and a server starts only on one it can write.

Why a lock: a second ``skyrl-sdk serve`` on the same ``--state-dir`` used to start, and its
start-up cleanup deleted the first server's offloaded adapters (that server's clients then
lost weights, gradients and moments). :class:`StateDirLock` is an exclusive ``flock`` on
``<state-dir>/server.lock``, held for the server's life (the kernel drops it when the process
ends, however it ends); the file names its holder, so the refusal can say who.

Why a check: on a full disk the start ended in a raw traceback, and on a read-only state dir
the server started and answered every write with a 500. :func:`check_writable` writes and
syncs a small file and commits one SQLite write before anything else; any failure is a
:class:`StateDirError`, which ``skyrl-sdk serve`` prints as one ``cannot start: ...`` line.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sqlite3
import time
from pathlib import Path

from ...errors import InputError

LOCK_NAME = "server.lock"
DATABASE_NAME = "server.sqlite3"
#: bytes the start-up check writes and syncs (a full disk refuses them)
_PROBE_BYTES = 64 * 1024


class StateDirError(InputError):
    """The state dir cannot be used: another server holds it, or it cannot be written."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return (exc.strerror or str(exc)).lower()
    return str(exc)


class StateDirLock:
    """An exclusive lock on a state dir (``acquire``), released by ``release`` or the process's end."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: str | os.PathLike, holder: str | None = None) -> StateDirLock:
        """Create the state dir if needed and lock it; :class:`StateDirError` naming the dir and
        the holder when another server has it. ``holder``: what this process is, for others."""
        root = Path(state_dir).expanduser().resolve()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateDirError(f"state dir {root} cannot be created: {_reason(exc)}") from None
        try:
            fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirError(f"state dir {root} cannot be written (creating {LOCK_NAME}): {_reason(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 1000, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise StateDirError(f"state dir {root} is in use by another server ({other}); stop it first, or give "
                                f"this one another --state-dir") from None
        except OSError as exc:
            os.close(fd)
            raise StateDirError(f"state dir {root}: cannot lock {LOCK_NAME}: {_reason(exc)}") from None
        lock = cls(root, fd)
        try:
            text = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}" + \
                (f": {holder}" if holder else "")
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode() + b"\n", 0)
        except OSError as exc:
            lock.release()
            raise StateDirError(f"state dir {root}: cannot write {LOCK_NAME}: {_reason(exc)}") from None
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock


def check_writable(root: Path) -> None:
    """Write, sync and remove a small file in ``root`` and commit one write to its database;
    :class:`StateDirError` with the reason (read-only, full, not a directory, a broken database)."""
    probe = root / f".write-check-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            data = memoryview(b"\0" * _PROBE_BYTES)
            while data:  # a short write is followed by the one that fails
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise StateDirError(f"state dir {root} cannot be written: {_reason(exc)}") from None
    try:
        db = sqlite3.connect(str(root / DATABASE_NAME), timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS state_dir_checks (id INTEGER PRIMARY KEY, at REAL)")
            db.execute("INSERT OR REPLACE INTO state_dir_checks VALUES (1, ?)", (time.time(),))
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise StateDirError(f"state dir {root}: its database {DATABASE_NAME} cannot be written: {exc}") from None
