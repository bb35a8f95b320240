"""Request dispatch on one rank: ``(engine id, op, payload)`` -> ``RankEngine.op_<op>(**payload)``.

Answers are ``("ok", result)`` or ``("error", details)``; ``details`` says whether the rank
failed before its first collective ("clean": the engine is still consistent) and whether
the error looks like a communication failure (a symptom of another rank's failure).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from skyrl_sdk import errors

from .session import DistSession

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
