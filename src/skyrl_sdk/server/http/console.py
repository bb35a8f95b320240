"""The console: ``GET /`` serves a page (static files shipped in the package, no CDN) that shows
an owner their training runs, curves and checkpoints, and operators the server.

The page and its two files carry no data and need no key (:data:`~.guard.CONSOLE_STATIC`);
everything it shows comes from ``/console/api/*``, behind the API key like every route, with
the API's isolation: another owner's run reads as unknown (404). The key stays in the browser
(typed in, or given as ``#key=...``: a fragment never reaches the server or its logs).
Endpoints, fields and limits: docs/server.md ("Console").
"""

from __future__ import annotations

import collections
import importlib.resources
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...version import __version__
from ..compute.runtime import Runtime
from ..settings import SETTINGS
from ..state.history import MAX_POINTS
from .edge import default_max_connections
from .guard import CONSOLE_STATIC
from .routes import owner, query_integer, runtime

router = APIRouter()

#: most runs one page of the run list holds
MAX_RUNS_PAGE = 200
_MEDIA = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
#: the page loads only its own files and talks only to this server; nothing is cached (a new
#: version of the server serves a new page)
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY",
            "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                                       "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'"}


def _static_file(path: str) -> tuple[str, str]:
    """URL path -> (file under ``static/``, media type)."""
    name = "index.html" if path == "/" else path.rsplit("/", 1)[1]
    return name, _MEDIA[name.rsplit(".", 1)[1]]


def _static_route(path: str) -> Callable[[], Awaitable[Response]]:
    name, media = _static_file(path)

    async def static() -> Response:
        body = (importlib.resources.files(__package__) / "static" / name).read_bytes()
        return Response(body, media_type=media, headers=_HEADERS)

    static.__name__ = f"console_{name.replace('.', '_')}"
    return static


for _path in sorted(CONSOLE_STATIC):
    router.get(_path)(_static_route(_path))


# ---- runs ---------------------------------------------------------------------------------------
@router.get("/console/api/me")
async def me(request: Request) -> dict:
    rt, who = runtime(request), owner(request)
    return {"owner": who, "operator": rt.config.is_operator(who), "key_required": rt.config.owners() is not None,
            "version": __version__, "models": list(rt.config.models), "session_timeout_s": rt.config.session_timeout_s}


@router.get("/console/api/runs")
async def runs(request: Request) -> dict:
    limit = query_integer(request, "limit", 50, 1, MAX_RUNS_PAGE)
    offset = query_integer(request, "offset", 0, 0)
    return await runtime(request).catalog.console_runs(owner(request), limit, offset)


@router.get("/console/api/runs/{run_id}")
async def run_detail(run_id: str, request: Request) -> dict:
    return await runtime(request).catalog.console_run(owner(request), run_id)


@router.get("/console/api/runs/{run_id}/curves")
async def curves(run_id: str, request: Request) -> Response:
    points = query_integer(request, "points", 1000, 2, MAX_POINTS)
    body = await runtime(request).catalog.curves_body(owner(request), run_id, points)
    return Response(body, media_type="application/json")


# ---- the server (operators) -----------------------------------------------------------------------
def _bases(rt: Runtime, loaded: dict[str, Any]) -> list[dict[str, Any]]:
    models = dict(rt.models)
    out = []
    for b in loaded["bases"]:
        adapters = []
        for a in b["adapters"]:
            model = models.get(a["label"])
            adapters.append({"model_id": a["label"] if model is not None else None,
                             "owner": model.owner if model is not None else None,
                             "rank": a["rank"], "bytes": a["bytes"], "offloaded": a["offloaded"]})
        out.append({k: b[k] for k in ("model", "dtype", "device", "base_bytes", "adapter_bytes", "max_adapters",
                                      "adapters_in_memory", "offloads", "reloads")}
                   | {"adapters_offloaded": sum(a["offloaded"] for a in adapters), "adapters": adapters})
    return out


def _work(rt: Runtime) -> list[dict[str, Any]]:
    """Per owner: live models, models with work queued or running, requests not finished."""
    rows: dict[str, dict[str, int]] = collections.defaultdict(
        lambda: {"live_models": 0, "busy_models": 0, "requests_in_flight": 0})
    for model in list(rt.models.values()):
        if not model.closed and model.error is None:
            rows[model.owner]["live_models"] += 1
            rows[model.owner]["busy_models"] += model.worker.idle_for() == 0.0
    for who, n in rt.futures.unfinished_by_owner().items():
        rows[who]["requests_in_flight"] += n
    return [{"owner": who, **counts} for who, counts in sorted(rows.items())]


def _syncs(rt: Runtime) -> list[dict[str, Any]]:
    """Per live training model whose sampler keeps its own copy of the weights: its last sync
    (``seconds``: all the next sample waited for the weights)."""
    out = []
    for model in list(rt.models.values()):
        backend = model.backend
        sampler = getattr(backend, "sampler", None) if backend is not None else None
        last = getattr(sampler, "last_sync", None)
        if sampler is not None and isinstance(last, dict):
            out.append({"model_id": model.model_id, "owner": model.owner, "sampler": sampler.name,
                        **{k: last.get(k) for k in ("kind", "seconds", "bytes", "version", "engines", "transfer")}})
    return out


def limits_table(rt: Runtime) -> list[dict[str, Any]]:
    """The limits table: every setting declared ``console=True`` (server/settings.py), by its flag
    (or its name), with the value in force, its unit, and what an unset one means."""
    in_force = {"max_connections": rt.config.max_connections or default_max_connections()}
    return [{"setting": s.name, "flag": s.flag, "unit": s.unit, "unset": s.default_text.replace("`", ""),
             "value": in_force.get(s.name, getattr(rt.config, s.name))} for s in SETTINGS if s.console]


@router.get("/console/api/server", response_model=None)
async def server(request: Request) -> JSONResponse | dict[str, Any]:
    rt, who = runtime(request), owner(request)
    if not rt.config.is_operator(who):
        return JSONResponse({"detail": "the server view is for operators (the --api-key holder, or owners marked "
                                       "'operator' in --api-keys)"}, status_code=403)
    loaded = rt.served.loaded()
    copies = [{**c, "model": rt.redact(str(c["model"]))} for c in loaded["own_copies"]]  # tinker:// paths only
    return {"bases": _bases(rt, loaded), "own_copies": copies, "memory": loaded["memory"],
            "snapshots": rt.sampling.snapshots.stats(), "work": _work(rt), "limits": limits_table(rt),
            "weight_syncs": _syncs(rt),
            "history_dropped": rt.catalog.history_dropped()}
