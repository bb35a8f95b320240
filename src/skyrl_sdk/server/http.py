"""Small helpers shared by the route modules."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from ..errors import InputError
from .futures import FutureRecord, Result


def runtime(request: Request):
    return request.app.state.runtime


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body (an empty body is ``{}``); InputError when it is not one."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(f"request body: expected a JSON object, got {type(obj).__name__}")
    return obj


def future_json(rec: FutureRecord, **extra: Any) -> dict[str, Any]:
    return {"request_id": rec.request_id, "model_id": rec.model_id, **extra}


async def submit(request: Request, make) -> dict[str, Any]:
    """Run ``make(runtime, body) -> FutureRecord``; a body that cannot be read still gets a
    future, failed with a user error (the client raises it at once instead of retrying)."""
    rt = runtime(request)
    try:
        body = await json_body(request)
    except InputError as exc:
        rec = rt.futures.create(None)
        rt.futures.finish(rec, Result.from_exception(exc))
        return future_json(rec)
    return future_json(make(rt, body))
