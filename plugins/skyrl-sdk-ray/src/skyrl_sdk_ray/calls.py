"""Waiting for actor calls, and naming the actor when one died.

Ray fails a call whose actor died (its process killed, its node lost) with ``RayActorError``
within about a second of the death; :func:`gather` polls every call so the first death ends the
wait at once, names the actor (``names[i]``) and says what Ray reported, instead of waiting for
the others (which may be stuck waiting for the dead one in a collective).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class ActorGone(Exception):
    """An actor died while a call to it ran (or before it began)."""

    def __init__(self, index: int, name: str, cause: str) -> None:
        super().__init__(f"{name} died ({cause})")
        self.index, self.name, self.cause = index, name, cause


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    short = next((line for line in text if "died" in line.lower() or "killed" in line.lower()), text[0] if text else "")
    return f"{type(exc).__name__}: {short[:300]}"


def gather(refs: Sequence[Any], names: Sequence[str], *, timeout_s: float | None = None,
           poll_s: float = 0.2) -> list[Any]:
    """The results of ``refs`` in order; :class:`ActorGone` for the first actor found dead; an
    error a call raised is raised as its own type (``RayTaskError``'s cause); ``TimeoutError``
    naming the calls still pending after ``timeout_s``."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    pending = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    start = time.monotonic()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
        for ref in ready:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except RayActorError as exc:
                raise ActorGone(i, names[i], _cause(exc)) from exc
            except RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
        if timeout_s is not None and pending and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no answer within {timeout_s:.0f}s from {[names[i] for i in pending.values()]}")
    return results
