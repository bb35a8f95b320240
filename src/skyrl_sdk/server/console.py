"""The console: ``GET /`` serves a page (static files shipped in the package, no CDN) that shows
an owner their training runs, curves and checkpoints, and operators the server.

The page and its two files carry no data and need no key (:data:`~.guard.CONSOLE_STATIC`);
everything it shows comes from ``/console/api/*``, behind the API key like every route, with
the API's isolation: another owner's run reads as unknown (404). The key stays in the browser
(typed in, or given as ``#key=...``: a fragment never reaches the server or its logs).
Endpoints, fields and limits: docs/server.md ("Console").
"""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import InputError, NotFoundError
from ..version import __version__
from .edge import default_max_connections
from .guard import CONSOLE_STATIC
from .history import MAX_POINTS
from .routes import owner, runtime
from .runtime import Runtime
from .store import iso

router = APIRouter()

#: a model whose worker had work within this many seconds is "live", else "idle"
LIVE_S = 30.0
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


def _static_route(path: str):
    name, media = _static_file(path)

    async def static() -> Response:
        body = (importlib.resources.files(__package__) / "static" / name).read_bytes()
        return Response(body, media_type=media, headers=_HEADERS)

    static.__name__ = f"console_{name.replace('.', '_')}"
    return static


for _path in sorted(CONSOLE_STATIC):
    router.get(_path)(_static_route(_path))


def _in_range(name: str, value: int, low: int, high: int | None = None) -> int:
    if value < low or (high is not None and value > high):
        wanted = f"in {low}..{high}" if high is not None else f">= {low}"
        raise InputError(f"{name}: expected an integer {wanted}, got {value}")
    return value


# ---- runs -----------------------------------------------------------------------------------------
def _status(rt: Runtime, run_id: str) -> str:
    """live (in memory, work within LIVE_S), idle (in memory, none since), freed (not in memory:
    released, its session ended, creation failed, or the server restarted)."""
    model = rt.models.get(run_id)
    if model is None or model.closed or model.error is not None:
        return "freed"
    return "live" if model.worker.idle_for() < LIVE_S else "idle"


def _sampling_sessions(rt: Runtime) -> dict[str, list[str]]:
    """Run id -> ids of this process's sampling sessions on it (its live weights or its checkpoints)."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for sid, s in list(rt.sampling.sessions.items()):
        if s.model is not None:
            out[s.model.model_id].append(sid)
        elif s.model_path and s.model_path.startswith("tinker://"):
            out[s.model_path[len("tinker://"):].split("/", 1)[0]].append(sid)
    return out


def _run_json(rt: Runtime, run: dict[str, Any], summary: dict[str, Any], sessions: list[str]) -> dict[str, Any]:
    lora = run["lora"]
    return {"model_id": run["run_id"], "base_model": run["base_model"], "lora_rank": lora["rank"] if lora else None,
            "session_id": run["session_id"], "created": iso(run["created_at"]),
            "last_request": iso(run["last_request_time"]), "status": _status(rt, run["run_id"]),
            "steps": summary["steps"], "last": summary["last"], "sampling_sessions": len(sessions)}


def _owned_run(rt: Runtime, who: str, run_id: str) -> dict[str, Any]:
    run = rt.store.run(run_id, who)
    if run is None:
        raise NotFoundError(f"unknown training run {run_id!r}")
    return run


@router.get("/console/api/me")
async def me(request: Request) -> dict:
    rt, who = runtime(request), owner(request)
    return {"owner": who, "operator": rt.config.is_operator(who), "key_required": rt.config.owners() is not None,
            "version": __version__, "models": list(rt.config.models)}


@router.get("/console/api/runs")
async def runs(request: Request, limit: int = 50, offset: int = 0) -> dict:
    rt, who = runtime(request), owner(request)
    limit, offset = _in_range("limit", limit, 1, MAX_RUNS_PAGE), _in_range("offset", offset, 0)
    rows, total = rt.store.list_runs(who, limit, offset)
    summaries = await asyncio.to_thread(rt.history.summaries, [r["run_id"] for r in rows])
    sessions = _sampling_sessions(rt)
    return {"runs": [_run_json(rt, r, summaries[r["run_id"]], sessions.get(r["run_id"], [])) for r in rows],
            "total": total, "limit": limit, "offset": offset}


@router.get("/console/api/runs/{run_id}")
async def run_detail(run_id: str, request: Request) -> dict:
    rt, who = runtime(request), owner(request)
    run = _owned_run(rt, who, run_id)
    summary = (await asyncio.to_thread(rt.history.summaries, [run_id]))[run_id]
    sessions = _sampling_sessions(rt).get(run_id, [])
    return {**_run_json(rt, run, summary, sessions), "sampling_session_ids": sorted(sessions)[-50:],
            "checkpoints": rt.store.list_checkpoints(who, run_id)[0]}


@router.get("/console/api/runs/{run_id}/curves")
async def curves(run_id: str, request: Request, points: int = 1000) -> dict:
    rt, who = runtime(request), owner(request)
    points = _in_range("points", points, 2, MAX_POINTS)
    _owned_run(rt, who, run_id)
    return await asyncio.to_thread(rt.history.curves, run_id, points)


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


def _limits(rt: Runtime) -> dict[str, Any]:
    c = rt.config
    return {"engine": c.engine, "sampler": c.sampler, "sampler_config": dict(c.sampler_config),
            "models": list(c.models), "share_base": c.share_base,
            "max_memory_bytes": c.max_memory, "max_lora_adapters": c.max_lora_adapters,
            "snapshot_memory_bytes": c.snapshot_memory, "session_timeout_s": c.session_timeout_s,
            "max_seq_len": c.max_seq_len, "max_num_samples": c.max_num_samples, "max_body_bytes": c.max_body_bytes,
            "max_tokens_per_request": c.max_tokens_per_request, "max_queued_requests": c.max_queued_requests,
            "header_timeout_s": c.header_timeout_s,
            "max_connections": c.max_connections or default_max_connections()}


@router.get("/console/api/server")
async def server(request: Request):
    rt, who = runtime(request), owner(request)
    if not rt.config.is_operator(who):
        return JSONResponse({"detail": "the server view is for operators (the --api-key holder, or owners marked "
                                       "'operator' in --api-keys)"}, status_code=403)
    loaded = rt.served.loaded()
    return {"bases": _bases(rt, loaded), "own_copies": loaded["own_copies"], "memory": loaded["memory"],
            "snapshots": rt.sampling.snapshots.stats(), "work": _work(rt), "limits": _limits(rt),
            "history_dropped": rt.history.dropped}
