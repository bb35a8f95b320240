"""``tinker://`` paths and the ids and names they are made of, checked before anything is
built from them (a name or id can never point outside the state dir)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

import attrs

from ...errors import InputError, quoted

#: tinker path segment -> checkpoint type (Tinker's names)
SEGMENT_TO_KIND = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
KIND_TO_SEGMENT = {v: k for k, v in SEGMENT_TO_KIND.items()}
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")


def check_name(name: Any, what: str = "checkpoint name") -> str:
    """A checkpoint name: letters, digits, ``_ . -``; no slashes, no leading dot."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise InputError(
            f"invalid {what} {quoted(name)}: use 1-200 characters from A-Z a-z 0-9 _ . - "
            f"(no '/', no '..', not starting with '.' or '-')"
        )
    return name


def check_run_id(run_id: Any, what: str = "training run id") -> str:
    """An id made of letters, digits and ``_ . : -`` (session, model and run ids)."""
    if not isinstance(run_id, str) or not ID_RE.fullmatch(run_id) or ".." in run_id:
        raise InputError(f"invalid {what} {quoted(run_id)}: use 1-200 characters from A-Z a-z 0-9 _ . : -")
    return run_id


#: the last instant a date can show (year 9999)
_LAST = datetime.max.replace(tzinfo=timezone.utc)


def iso(ts: float | None) -> str | None:
    """A time stamp as ISO 8601 (UTC). One past year 9999 (an expiry a state dir of an earlier
    version may hold) shows as the last representable instant rather than failing the answer."""
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()
    except (OverflowError, ValueError, OSError):
        return _LAST.isoformat() if ts > 0 else datetime.fromtimestamp(0, tz=timezone.utc).isoformat()


@attrs.frozen
class TinkerPath:
    """A parsed ``tinker://<run_id>/<weights|sampler_weights>/<name>``."""

    run_id: str
    kind: str  # "training" | "sampler"
    name: str

    @classmethod
    def parse(cls, path: Any) -> TinkerPath:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise InputError(f"expected a tinker:// path, got {quoted(path)}")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENT_TO_KIND:
            raise InputError(
                f"invalid tinker path {quoted(path)}: expected tinker://<training_run_id>/weights/<name>, "
                f"tinker://<training_run_id>/sampler_weights/<name> or "
                f"tinker://<training_run_id>/external_weights/<name>"
            )
        return cls(check_run_id(parts[0]), SEGMENT_TO_KIND[parts[1]], check_name(parts[2]))

    def __str__(self) -> str:
        return f"tinker://{self.run_id}/{KIND_TO_SEGMENT[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_TO_SEGMENT[self.kind]}/{self.name}"
