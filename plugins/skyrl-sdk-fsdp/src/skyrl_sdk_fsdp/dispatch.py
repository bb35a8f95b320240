"""Request dispatch on one rank: ``(engine id, op, payload)`` -> ``RankEngine.op_<op>(**payload)``,
and the torchrun job (:class:`TorchrunJob`) whose ranks carry those requests.

One direction: the process entry points (:mod:`.entrypoint`) and the controller
(:mod:`.engine`) use this module; it uses the session and the rank engine, never them.

Answers are ``("ok", result)`` or ``("error", details)``; ``details`` says whether the rank
failed before its first collective ("clean": the engine is still consistent) and whether
the error looks like a communication failure (a symptom of another rank's failure).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist

from skyrl_sdk import errors

from . import control
from .options import ENV_PREFIX
from .session import DistSession, init_session

logger = logging.getLogger(__name__)


def describe_error(exc: BaseException, rank: int, clean: bool) -> dict:
    """A picklable description of an exception raised on a rank."""
    kind = type(exc).__name__
    message = str(exc)
    comm = kind in ("DistBackendError", "DistNetworkError", "DistStoreError") or any(
        s in message for s in ("[gloo", "Connection closed by peer", "Connection reset", "NCCL", "Broken pipe")
    )
    return {
        "rank": rank,
        "type": kind,
        "message": message,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "clean": clean,
        "comm": comm,
    }


class Dispatcher:
    """Runs requests on one rank; holds this process's engines (several under torchrun)."""

    def __init__(self, session: DistSession) -> None:
        self.session = session
        self.engines: dict[int, Any] = {}

    def handle(self, engine_id: int, op: str, payload: dict) -> tuple[str, Any]:
        engine = self.engines.get(engine_id)
        if engine is not None:
            engine.in_collectives = False
        try:
            if op == "init":
                from .rank_engine import RankEngine

                self.engines[engine_id] = RankEngine(self.session, **payload)
                return "ok", self.engines[engine_id].info()
            if op == "close":
                closing = self.engines.pop(engine_id, None)
                if closing is not None:
                    closing.close()
                return "ok", None
            if engine is None:
                raise errors.EngineError(f"no fsdp engine {engine_id} on rank {self.session.rank}")
            return "ok", getattr(engine, f"op_{op}")(**payload)
        except Exception as exc:
            clean = op == "init" or (engine is not None and not engine.in_collectives)
            logger.debug("rank %d: %s failed", self.session.rank, op, exc_info=True)
            return "error", describe_error(exc, self.session.rank, clean)


class TorchrunJob:
    """The torchrun job of this process: created on first use, identically on every rank."""

    _lock = threading.Lock()
    _current: TorchrunJob | None = None

    def __init__(self, session: DistSession, dispatcher: Dispatcher) -> None:
        self.session = session
        self.dispatcher = dispatcher
        self.closed = False
        self._next_engine_id = 0

    @classmethod
    def get(cls, timeout_s: float | None = None) -> TorchrunJob:
        from .options import launcher_env

        with cls._lock:
            if cls._current is not None:
                return cls._current
            env = launcher_env()
            if env is None:
                raise errors.InputError(
                    "engine_config['launcher']='torchrun' but RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are not set: "
                    "start the script with torchrun"
                )
            if timeout_s is None:
                timeout_s = float(os.environ.get(ENV_PREFIX + "TIMEOUT_S", "1800"))
            device_type = os.environ.get(ENV_PREFIX + "DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
            session = init_session(
                rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device_type=device_type,
                timeout_s=timeout_s, control_group=True,
            )
            job = cls._current = cls(session, Dispatcher(session))
            if env.rank == 0:
                atexit.register(job.release_ranks)
            return job

    def new_engine_id(self) -> int:
        """Engines are numbered in creation order, the same on every rank (SPMD)."""
        with self._lock:
            engine_id = self._next_engine_id
            self._next_engine_id += 1
            return engine_id

    def release_ranks(self) -> None:
        """Rank 0 at exit: tell ranks 1..N-1 to leave their loop."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            control.send([(None, "exit", None)] * self.session.world_size, self.session.control_group)
        except Exception:  # peers already gone: torchrun tears the job down anyway
            pass
        control.keep_last_message_alive()
        # Shut the process groups down now, in order, rather than leave it to interpreter teardown.
        try:
            dist.destroy_process_group()
        except Exception:
            pass
