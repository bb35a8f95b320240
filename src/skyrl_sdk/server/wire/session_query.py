"""Tinker's ``SessionSearchRequest`` (``POST /api/v1/sessions/search``) as a typed value.

Every field is checked here, by name, before the search reads a row: a filter of the wrong
shape (``"statuses": ["active"]``, ``[null]``, ``5``) is a 400 naming it, never a 500 halfway
through the search. The shapes are the tinker client's (0.38): status queries ``{"type":
"active" | "cancelled" | "failed" | "client_finished", "reasons": [...]}``, owners ``{"type":
"own" | "accessible" | "user", "owner_urns": [...]}``, the cursor a previous page's
``next_cursor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import attrs

from ...errors import InputError, quoted, refuse_unknown_keys
from ...types.numbers import check_number

#: the one project every session of this server is in
PROJECT_ID = "default"
STATUS_TYPES = ("active", "cancelled", "failed", "client_finished")
FINISH_REASONS = ("success", "errored", "interrupted")
OWNER_TYPES = ("own", "accessible", "user")
MAX_PAGE = 200


@attrs.frozen
class StatusQuery:
    """One of ``statuses``: a status type, and for ``client_finished`` the reasons it matches
    (None: any)."""

    type: str
    reasons: tuple[str, ...] | None = None


@attrs.frozen
class SessionSearch:
    session_id: str | None = None
    user_metadata: dict[str, str] = attrs.Factory(dict)
    #: the words of ``display_name``, lower-cased (each must appear in a match's name)
    words: tuple[str, ...] = ()
    statuses: tuple[StatusQuery, ...] | None = None
    limit: int = 50
    #: ``(created_at, session_id)`` of the previous page's last session
    cursor: tuple[float, str] | None = None


def parse_session_search(body: Mapping[str, Any]) -> SessionSearch:
    """The search ``body`` (its keys already checked against the route's) as a :class:`SessionSearch`."""
    projects = body.get("project_ids")
    if projects is not None and (not isinstance(projects, list) or set(map(str, projects)) - {PROJECT_ID}
                                 or not all(isinstance(p, str) for p in projects)):
        raise InputError(f"project_ids: this server has one project, {PROJECT_ID!r}; got {quoted(projects)}")
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"user_metadata: expected an object of exact string key/value matches, got {quoted(metadata)}")
    name = body.get("display_name")
    if name is not None and not isinstance(name, str):
        raise InputError(f"display_name: expected a string, got {quoted(name)}")
    session_id = body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise InputError(f"session_id: expected a string, got {quoted(session_id)}")
    _check_owner(body.get("owner"))
    return SessionSearch(session_id=session_id, user_metadata=dict(metadata), words=tuple((name or "").lower().split()),
                         statuses=_statuses(body.get("statuses")),
                         limit=check_number("limit", body.get("limit", 50), low=1, high=MAX_PAGE, integer=True),
                         cursor=_cursor(body.get("cursor")))


def _statuses(value: Any) -> tuple[StatusQuery, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise InputError(f"statuses: expected a non-empty list of status queries such as {{\"type\": \"active\"}}, "
                         f"got {quoted(value)}")
    out = []
    for i, query in enumerate(value):
        where = f"statuses[{i}]"
        if not isinstance(query, dict):
            raise InputError(f"{where}: expected an object such as {{\"type\": \"active\"}}, got {quoted(query)}")
        refuse_unknown_keys(where, query, ("type", "reasons"))
        kind = query.get("type")
        if kind not in STATUS_TYPES:
            raise InputError(f"{where}.type: expected one of {list(STATUS_TYPES)}, got {quoted(kind)}")
        reasons = query.get("reasons")
        if reasons is not None:
            if kind != "client_finished":
                raise InputError(f"{where}.reasons: only a client_finished query has reasons")
            if not isinstance(reasons, list) or not reasons or any(r not in FINISH_REASONS for r in reasons):
                raise InputError(f"{where}.reasons: expected a non-empty list of {list(FINISH_REASONS)}, "
                                 f"got {quoted(reasons)}")
            reasons = tuple(reasons)
        out.append(StatusQuery(kind, reasons))
    return tuple(out)


def _check_owner(value: Any) -> None:
    """Whose sessions: any owner type reads as the caller's own (no owner sees another's here),
    but the shape is the client's."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in OWNER_TYPES:
        raise InputError(f"owner: expected {{\"type\": one of {list(OWNER_TYPES)}}}, got {quoted(value)}")
    refuse_unknown_keys("owner", value, ("type", "owner_urns"))
    urns = value.get("owner_urns")
    if urns is not None and (not isinstance(urns, list) or not all(isinstance(u, str) for u in urns)):
        raise InputError(f"owner.owner_urns: expected a list of strings, got {quoted(urns)}")


def _cursor(value: Any) -> tuple[float, str] | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(str(value["last_created_at"]).replace("Z", "+00:00"))
        session_id = value["last_session_id"]
        if not isinstance(session_id, str):
            raise TypeError
        return when.replace(tzinfo=when.tzinfo or timezone.utc).timestamp(), session_id
    except (TypeError, KeyError, ValueError, OverflowError):
        raise InputError(f"cursor: expected a previous page's next_cursor, got {quoted(value)}") from None
