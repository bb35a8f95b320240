"""The RestClient's checkpoint and session routes beyond listing (publish, time to live,
external weights links and their downloads, session search), and one clean 404 for every
client route this server declines (:mod:`.compat`).

Registered before :mod:`.routes`, whose ``DELETE .../checkpoints/{checkpoint_id:path}``
would otherwise take ``DELETE .../publish`` for a checkpoint name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse

from ..wire import envelopes
from ..wire.compat import ROWS, not_served_detail
from ..wire.session_query import parse_session_search
from .routes import json_body, runtime
from .routes import owner as _owner

router = APIRouter(prefix="/api/v1")
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{segment}/{name}"


@router.post(CHECKPOINT + "/publish")
async def publish(run_id: str, segment: str, name: str, request: Request) -> dict:
    await runtime(request).catalog.publish(_owner(request), run_id, f"{segment}/{name}", True)
    return {}


@router.delete(CHECKPOINT + "/publish")
async def unpublish(run_id: str, segment: str, name: str, request: Request) -> dict:
    await runtime(request).catalog.publish(_owner(request), run_id, f"{segment}/{name}", False)
    return {}


@router.put(CHECKPOINT + "/ttl")
async def set_ttl(run_id: str, segment: str, name: str, request: Request) -> dict:
    ttl = envelopes.parse_set_ttl(await json_body(request, "set_ttl"))
    await runtime(request).catalog.set_ttl(_owner(request), run_id, f"{segment}/{name}", ttl)
    return {}


@router.get(CHECKPOINT + "/external_weights_urls")
async def external_weights_urls(run_id: str, segment: str, name: str, request: Request) -> dict:
    """Signed links to the files of one of the caller's own exports (another owner reads a
    published checkpoint by loading it, and may export that run of its own)."""
    rt = runtime(request)
    target = await rt.catalog.export_target(_owner(request), f"tinker://{run_id}/{segment}/{name}")
    return rt.downloads.sign(target, str(request.base_url))


@router.get("/downloads/{token}/{file:path}")
async def download(token: str, file: str, request: Request) -> FileResponse:
    """A signed link's file (no API key: the token is the credential, see the guard), checked
    against the catalog on a thread (the store's lock may be held by a save)."""
    path = await asyncio.to_thread(runtime(request).downloads.file, token, file)
    return FileResponse(path, media_type="application/octet-stream")


@router.post("/sessions/search")
async def search_sessions(request: Request) -> dict:
    search = parse_session_search(await json_body(request, "search_sessions"))
    return await runtime(request).catalog.search_sessions(_owner(request), search)


def _declined(method: str, path: str) -> Callable[[], Awaitable[JSONResponse]]:
    async def handler() -> JSONResponse:
        return JSONResponse({"detail": not_served_detail(method, path)}, status_code=404)

    handler.__name__ = f"not_served_{method.lower()}_{path.replace('/', '_').strip('_')}"
    return handler


for (_method, _path), (_served, _, _) in ROWS.items():
    if not _served:
        router.add_api_route(_path.removeprefix("/api/v1"), _declined(_method, _path), methods=[_method])
