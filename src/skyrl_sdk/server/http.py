"""Small helpers shared by the route modules: the runtime, the caller's owner, bodies."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from . import wire
from .guard import OWNER_SCOPE_KEY
from .runtime import Runtime


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def owner(request: Request) -> str:
    """The owner of the request's API key (set by :class:`~.guard.Guard`)."""
    return request.scope[OWNER_SCOPE_KEY]


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body (an empty body is ``{}``); InputError when it is not one."""
    return wire.json_object(await request.body())


async def submit(request: Request, route: str) -> dict[str, Any]:
    """A future route: the runtime accepts the body and answers with a request id."""
    return runtime(request).submit(owner(request), route, await request.body(),
                                   request.headers.get("content-type", ""))
