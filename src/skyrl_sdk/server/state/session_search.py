"""Tinker's session search (``POST /api/v1/sessions/search``, the RestClient's
``search_sessions``): sessions are only ever the caller's own. Every search owner type (own,
accessible, listed users) reads as the caller's sessions, since no owner may see another's here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..wire.session_query import PROJECT_ID, SessionSearch, StatusQuery
from ..wire.tinker_paths import iso
from .store import Store


def _status(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A session's status as Tinker words it (None: neither running nor finished by its client)."""
    if row["finished_at"] is None:
        return {"type": "active"}
    reason = json.loads(row["finish_reason"]) if row["finish_reason"] else None
    if isinstance(reason, dict) and reason.get("type") in ("success", "errored", "interrupted"):
        return {"type": "client_finished", "reason": {"type": reason["type"]}}
    return None  # expired (no heartbeat), or a finish without a reason


def _matches_status(status: dict | None, queries: tuple[StatusQuery, ...]) -> bool:
    for q in queries:
        if status is not None and q.type == status["type"]:
            if status["type"] != "client_finished" or not q.reasons or status["reason"]["type"] in q.reasons:
                return True
    return False


def _after(row: Mapping[str, Any], cursor: tuple[float, str]) -> bool:
    """Whether ``row`` comes after the cursor's session, newest first (the cursor's time went
    through an ISO string: equal within a microsecond)."""
    when, session_id = cursor
    if abs(row["created_at"] - when) <= 1e-6:
        return row["session_id"] < session_id
    return row["created_at"] < when


def search_sessions(store: Store, owner: str, search: SessionSearch) -> dict[str, Any]:
    """One page of ``owner``'s sessions matching ``search`` (Tinker's ``SessionSearchRequest``,
    checked by :func:`~..wire.session_query.parse_session_search`), newest first."""
    rows, _ = store.list_sessions(owner, 10**9, 0)
    rows.sort(key=lambda r: (r["created_at"], r["session_id"]), reverse=True)
    page: list[dict[str, Any]] = []
    for row in rows:
        if search.cursor is not None and not _after(row, search.cursor):
            continue
        name = row["display_name"] or ""
        by_id = search.session_id is not None and row["session_id"] == search.session_id
        by_name = bool(search.words) and all(w in name.lower() for w in search.words)
        if (search.session_id is not None or search.words) and not (by_id or by_name):
            continue
        metadata = json.loads(row["user_metadata"]) if row["user_metadata"] else {}
        if any(k not in metadata or str(metadata[k]) != v for k, v in search.user_metadata.items()):
            continue
        status = _status(row)
        if search.statuses is not None and not _matches_status(status, search.statuses):
            continue
        if len(page) == search.limit:
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
