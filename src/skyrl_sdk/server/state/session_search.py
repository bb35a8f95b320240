"""Tinker's session search (``POST /api/v1/sessions/search``, the RestClient's
``search_sessions``): sessions are only ever the caller's own. Every search owner type (own,
accessible, listed users) reads as the caller's sessions, since no owner may see another's here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ...errors import InputError, quoted, refuse_unknown_keys
from ...types.numbers import check_number
from ..wire.tinker_paths import iso
from .store import Store

#: the one project every session of this server is in
PROJECT_ID = "default"
SEARCH_KEYS = ("session_id", "project_ids", "user_metadata", "display_name", "owner", "statuses", "limit", "cursor")


def _status(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A session's status as Tinker words it (None: neither running nor finished by its client)."""
    if row["finished_at"] is None:
        return {"type": "active"}
    reason = json.loads(row["finish_reason"]) if row["finish_reason"] else None
    if isinstance(reason, dict) and reason.get("type") in ("success", "errored", "interrupted"):
        return {"type": "client_finished", "reason": {"type": reason["type"]}}
    return None  # expired (no heartbeat), or a finish without a reason


def _matches_status(status: dict | None, queries: list[dict]) -> bool:
    for q in queries:
        if status is not None and q.get("type") == status["type"]:
            reasons = q.get("reasons")
            if status["type"] != "client_finished" or not reasons or status["reason"]["type"] in reasons:
                return True
    return False


def _cursor(value: Any) -> tuple[float, str] | None:
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(str(value["last_created_at"]).replace("Z", "+00:00"))
        return when.replace(tzinfo=when.tzinfo or timezone.utc).timestamp(), str(value["last_session_id"])
    except (TypeError, KeyError, ValueError):
        raise InputError(f"cursor: expected a previous page's next_cursor, got {quoted(value)}") from None


def _after(row: Mapping[str, Any], cursor: tuple[float, str]) -> bool:
    """Whether ``row`` comes after the cursor's session, newest first (the cursor's time went
    through an ISO string: equal within a microsecond)."""
    when, session_id = cursor
    if abs(row["created_at"] - when) <= 1e-6:
        return row["session_id"] < session_id
    return row["created_at"] < when


def search_sessions(store: Store, owner: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """One page of ``owner``'s sessions matching Tinker's ``SessionSearchRequest``, newest first."""
    refuse_unknown_keys("SessionSearchRequest", body, SEARCH_KEYS)
    limit = check_number("limit", body.get("limit", 50), low=1, high=200, integer=True)
    projects = body.get("project_ids")
    if projects is not None and (not isinstance(projects, list) or set(projects) - {PROJECT_ID}):
        raise InputError(f"project_ids: this server has one project, {PROJECT_ID!r}; got {quoted(projects)}")
    wanted = body.get("user_metadata") or {}
    if not isinstance(wanted, dict):
        raise InputError(f"user_metadata: expected an object of exact key/value matches, got {quoted(wanted)}")
    words = str(body.get("display_name") or "").lower().split()
    statuses, cursor = body.get("statuses"), _cursor(body.get("cursor"))
    rows, _ = store.list_sessions(owner, 10**9, 0)
    rows.sort(key=lambda r: (r["created_at"], r["session_id"]), reverse=True)
    page: list[dict[str, Any]] = []
    for row in rows:
        if cursor is not None and not _after(row, cursor):
            continue
        name = row["display_name"] or ""
        by_id = body.get("session_id") is not None and row["session_id"] == body["session_id"]
        by_name = bool(words) and all(w in name.lower() for w in words)
        if (body.get("session_id") is not None or words) and not (by_id or by_name):
            continue
        metadata = json.loads(row["user_metadata"]) if row["user_metadata"] else {}
        if any(str(metadata.get(k)) != str(v) or k not in metadata for k, v in wanted.items()):
            continue
        status = _status(row)
        if statuses is not None and not _matches_status(status, statuses):
            continue
        if len(page) == limit:
            last = page[-1]
            return {"sessions": page, "next_cursor": {"last_created_at": last["created_at"],
                                                      "last_session_id": last["session_id"]}}
        page.append(_summary(store, owner, row, metadata, status))
    return {"sessions": page, "next_cursor": None}


def _summary(store: Store, owner: str, row: Mapping[str, Any], metadata: dict, status: dict | None) -> dict[str, Any]:
    checkpoints = [c for run_id in store.run_ids_of_session(row["session_id"], owner)
                   for c in store.list_checkpoints(owner, run_id)[0]]
    return {"session_id": row["session_id"], "created_at": iso(row["created_at"]), "owner": owner,
            "project_id": PROJECT_ID, "status": status, "checkpoints_count": len(checkpoints),
            "display_name": row["display_name"], "user_metadata": {str(k): str(v) for k, v in metadata.items()} or None,
            "checkpoint_storage_bytes": sum(c["size_bytes"] or 0 for c in checkpoints)}
