"""Caps on what a client may make the server store: metadata sizes and open sessions.

Every session, run and checkpoint record keeps the client's ``user_metadata`` (and a session its
``tags``) in SQLite, and every session costs a record and a place in the reaper. Unbounded,
one client (or a web page, against a keyless server) filled the database: 3 MB of metadata per
session was accepted, and sessions without end. Each cap is checked before anything is stored,
and a request over it is refused with a user error naming the field and the cap.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import InputError

#: bytes of one ``user_metadata`` object, as compact JSON
MAX_METADATA_BYTES = 16 * 1024
#: tags of one session, and characters of one tag
MAX_TAGS, MAX_TAG_CHARS = 64, 256
#: a session's display name (Tinker's session search matches words in it)
MAX_DISPLAY_NAME_CHARS = 256


def metadata(value: Any, field: str = "user_metadata") -> dict | None:
    """``value`` if it is None or a JSON object of at most :data:`MAX_METADATA_BYTES`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"{field}: expected an object, got {type(value).__name__}")
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_METADATA_BYTES:
        raise InputError(f"{field}: {size} bytes of JSON; this server keeps at most {MAX_METADATA_BYTES} per object")
    return value


def display_name(value: Any) -> str | None:
    """``value`` if it is None or a string of at most :data:`MAX_DISPLAY_NAME_CHARS`."""
    if value is not None and (not isinstance(value, str) or len(value) > MAX_DISPLAY_NAME_CHARS):
        raise InputError(f"display_name: expected a string of at most {MAX_DISPLAY_NAME_CHARS} characters, "
                         f"got {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, str) else ""))
    return value


def tags(value: Any) -> list | None:
    """``value`` if it is None or a list of at most :data:`MAX_TAGS` strings of at most :data:`MAX_TAG_CHARS`."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InputError(f"tags: expected a list, got {type(value).__name__}")
    if len(value) > MAX_TAGS:
        raise InputError(f"tags: {len(value)} tags; this server keeps at most {MAX_TAGS} per session")
    for i, tag in enumerate(value):
        if not isinstance(tag, str) or len(tag) > MAX_TAG_CHARS:
            raise InputError(f"tags[{i}]: expected a string of at most {MAX_TAG_CHARS} characters")
    return value


def check_open_sessions(owner_open: int, limit: int) -> None:
    """Refuse one more session when the owner has ``limit`` open."""
    if owner_open >= limit:
        raise InputError(f"too many open sessions: {owner_open} of yours are open, and this server allows at most "
                         f"{limit} per owner (max_sessions_per_owner); finish some (ServiceClient.close) or let them "
                         f"expire, then create another")
