"""Controller <-> ranks: send one request to every rank, collect every answer, or fail clearly.

Two transports with one interface, ``request(op, payloads) -> list[result]``:

- :class:`SpawnTransport` (``launcher="spawn"``): this process starts ``world_size`` worker
  processes (``python -c ...``, not ``multiprocessing``: the user's ``__main__`` is never
  re-imported) and talks to each over an inherited socket pair with pickled plain data.
  The controller hosts the TCP store the ranks rendezvous through. While waiting it polls
  every rank's socket *and* its process, so a rank that dies is seen within a second.
- :class:`CollectiveTransport` (``launcher="torchrun"``): this process is rank 0; requests
  go to ranks 1..N-1 with :mod:`.control` and answers come back with ``gather_object``
  over a gloo control group; rank 0 runs its own share in-process.

Answers are ``("ok", result)`` or ``("error", details)``. When every rank failed "cleanly"
(before its first collective) with the same error, the engine is still consistent and the
error is re-raised as its own type (``ModelLoadError``, ...). Any other failure is fatal:
the ranks are stopped and :class:`~skyrl_sdk.errors.EngineError` names the rank and cause,
unless the cause is a plugin's (:class:`~skyrl_sdk.errors.PluginError`, kept as such).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

from skyrl_sdk import errors

from .options import ENV_PREFIX

if TYPE_CHECKING:
    from .dispatch import TorchrunJob

logger = logging.getLogger(__name__)

#: After the first failure, how long to wait for the other ranks' answers (to name the cause).
GRACE_S = 2.0
#: How long close() waits for the ranks to exit before terminating / killing them.
SHUTDOWN_S = 10.0

RESTART_HINT = "the fsdp engine's ranks were stopped; create a new Backend (and load_state) to continue"


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return str(code)


def _exit_description(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"died (killed by signal {_signal_name(-code)})"
    return f"exited with code {code}"


def _own_type(failure: dict) -> type | None:
    """The core error class a rank raised, when its type says whose fault it was: the caller's
    (:class:`~skyrl_sdk.errors.InputError`) or a plugin's (:class:`~skyrl_sdk.errors.PluginError`)."""
    cls = getattr(errors, failure["type"], None)
    return cls if isinstance(cls, type) and issubclass(cls, (errors.InputError, errors.PluginError)) else None


def judge_replies(op: str, replies: dict[int, Any], deaths: dict[int, str], world_size: int,
                  timed_out: bool = False) -> tuple[list, BaseException | None, bool]:
    """Turn the ranks' answers into results, or into (error, fatal)."""
    failures = {r: rep[1] for r, rep in replies.items() if rep[0] == "error"}
    if not deaths and not failures and not timed_out and len(replies) == world_size:
        return [replies[r][1] for r in range(world_size)], None, False
    if (not deaths and not timed_out and len(failures) == world_size
            and all(f["clean"] for f in failures.values())
            and len({(f["type"], f["message"]) for f in failures.values()}) == 1):
        first = failures[0]
        if (cls := _own_type(first)) is not None:
            return [], cls(first["message"]), False
        return [], errors.EngineError(
            f"fsdp engine: {op} failed on every rank: {first['type']}: {first['message']}\n"
            f"rank 0 traceback:\n{first['traceback']}"
        ), False
    # fatal: order causes so that the root cause comes first
    parts = [f"rank {r} {why}" for r, why in sorted(deaths.items())]
    ranked = sorted(failures.values(), key=lambda f: (f["comm"], f["rank"]))
    parts += [f"rank {f['rank']} raised {f['type']}: {f['message']}" for f in ranked]
    if timed_out:
        silent = sorted(set(range(world_size)) - set(replies) - set(deaths))
        parts.append(f"no answer from rank(s) {silent} within call_timeout_s")
    message = f"fsdp engine: {op} failed: " + "; ".join(parts) + f" ({RESTART_HINT})"
    root = next((f for f in ranked if not f["comm"]), None) if not deaths else None
    if root is not None:
        message += f"\nrank {root['rank']} traceback:\n{root['traceback']}"
        # A plugin's fault stays one (named first) though it broke the engine; an input error
        # found mid-call does not become the caller's alone: the engine is gone either way.
        if (cls := _own_type(root)) is not None and issubclass(cls, errors.PluginError):
            return [], cls(f"{root['message']}\n{message}"), True
    return [], errors.EngineError(message), True


class _Transport:
    """What both transports share: one request at a time, and no request after a failure."""

    world_size: int
    broken: str | None = None
    closed: bool = False
    _lock: Any

    def request(self, op: str, payloads: Sequence[Any]) -> list:
        """Send ``payloads[r]`` to rank r; return every rank's result, or raise the failure."""
        with self._lock:
            if self.closed:
                raise errors.EngineError("fsdp engine is closed")
            if self.broken:
                raise errors.EngineError(f"fsdp engine is unusable after an earlier failure: {self.broken}")
            try:
                replies, deaths, timed_out = self._exchange(op, payloads)
            except BaseException as exc:  # KeyboardInterrupt mid-call: ranks are out of step
                self._fail(f"{op} interrupted by {type(exc).__name__}")
                raise
            results, error, fatal = judge_replies(op, replies, deaths, self.world_size, timed_out)
            if error is not None:
                if fatal:
                    self._fail(str(error).split("\n", 1)[0])
                raise error
            return results

    def _exchange(self, op: str, payloads: Sequence[Any]) -> tuple[dict[int, Any], dict[int, str], bool]:
        """Send, then collect ``(replies by rank, deaths by rank, timed out)``."""
        raise NotImplementedError

    def _fail(self, reason: str) -> None:
        self.broken = reason


class SpawnTransport(_Transport):
    """Rank processes started and owned by this (controller) process."""

    def __init__(self, *, world_size: int, device_type: str, timeout_s: float, threads: int,
                 call_timeout_s: float | None = None) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        # The rendezvous store lives in the controller: its port stays bound (no port race).
        self._store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        env = dict(os.environ)
        path = [p for p in sys.path if p]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["OMP_NUM_THREADS"] = str(threads)
        env.update({
            ENV_PREFIX + "WORLD_SIZE": str(world_size),
            ENV_PREFIX + "PARENT_PID": str(os.getpid()),
            ENV_PREFIX + "STORE_HOST": "127.0.0.1",
            ENV_PREFIX + "STORE_PORT": str(self._store.port),
            ENV_PREFIX + "DEVICE": device_type,
            ENV_PREFIX + "TIMEOUT_S": str(timeout_s),
            ENV_PREFIX + "THREADS": str(threads),
        })
        code = "from skyrl_sdk_fsdp.entrypoint import spawned_main; spawned_main()"
        try:
            for rank in range(world_size):
                mine, theirs = socket.socketpair()
                env[ENV_PREFIX + "RANK"] = str(rank)
                env[ENV_PREFIX + "FD"] = str(theirs.fileno())
                proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(theirs.fileno(),))
                theirs.close()
                self.procs.append(proc)
                self.conns.append(Connection(mine.detach()))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _exchange(self, op: str, payloads: Sequence[Any]) -> tuple[dict[int, Any], dict[int, str], bool]:
        deaths: dict[int, str] = {}
        replies: dict[int, Any] = {}
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((op, payloads[rank]))
            except (OSError, EOFError):
                deaths[rank] = _exit_description(self._wait_exit(rank, 1.0))
        start = time.monotonic()
        first_failure: float | None = time.monotonic() if deaths else None
        pending = {r for r in range(self.world_size) if r not in deaths}
        timed_out = False
        while pending:
            ready = cast(list[Connection], wait([self.conns[r] for r in pending], timeout=0.2))  # what we passed
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    deaths[rank] = _exit_description(self._wait_exit(rank, 1.0))
                pending.discard(rank)
                if rank in deaths or (replies[rank][0] == "error" and not replies[rank][1]["clean"]):
                    first_failure = first_failure or time.monotonic()
            for rank in list(pending):
                code = self.procs[rank].poll()
                if code is not None and not self.conns[rank].poll():
                    deaths[rank] = _exit_description(code)
                    pending.discard(rank)
                    first_failure = first_failure or time.monotonic()
            now = time.monotonic()
            if first_failure is not None and now - first_failure > GRACE_S:
                break
            if self.call_timeout_s is not None and now - start > self.call_timeout_s:
                timed_out = True
                break
        return replies, deaths, timed_out

    def _wait_exit(self, rank: int, timeout: float) -> int | None:
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def _fail(self, reason: str) -> None:
        self.broken = reason
        logger.debug("fsdp engine failed (%s); stopping its ranks", reason)
        self._stop(graceful=False)

    def _stop(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(("shutdown", None))
                except (OSError, EOFError):
                    pass
            deadline = time.monotonic() + SHUTDOWN_S
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
                logger.error("fsdp rank pid %d did not exit", proc.pid)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        self.conns = []

    def close(self) -> None:
        """Stop the ranks (gracefully, then by force); idempotent; called at exit too."""
        if self.closed:
            return
        self.closed = True
        self._stop(graceful=self.broken is None)
        self._store = None


class CollectiveTransport(_Transport):
    """This process is rank 0 of a launcher-started (torchrun) job."""

    _lock = threading.RLock()  # one request at a time per process (engines share the group)

    def __init__(self, job: TorchrunJob, engine_id: int) -> None:
        self.job = job
        self.engine_id = engine_id
        self.world_size = job.session.world_size

    @property
    def pids(self) -> list[int]:
        return []

    def _exchange(self, op: str, payloads: Sequence[Any]) -> tuple[dict[int, Any], dict[int, str], bool]:
        import torch.distributed as dist

        from . import control

        group = self.job.session.control_group
        local = self.job.dispatcher.handle(*control.send([(self.engine_id, op, p) for p in payloads], group))
        gathered: list = [None] * self.world_size
        dist.gather_object(local, gathered, dst=0, group=group)
        return dict(enumerate(gathered)), {}, False

    def close(self) -> None:
        if self.closed:
            return
        if self.broken is None and not self.job.closed:
            try:
                self.request("close", [None] * self.world_size)
            except Exception:  # pragma: no cover - best effort at exit
                logger.debug("fsdp close failed", exc_info=True)
        self.closed = True
