"""Service routes: health, client config, sessions, telemetry, capabilities."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .http import json_body, runtime
from .store import iso

router = APIRouter(prefix="/api/v1")


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(request: Request) -> dict:
    # The client's defaults suit a loopback server; say that plain API keys are used and
    # that none of the optional server features (server-side losses, futures polling) exist.
    flags = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
             "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
             "sample_join_sampling_session": False}
    return {**flags, **runtime(request).config.client_config}


@router.post("/client/dynamic_config")
async def client_dynamic_config(request: Request) -> dict:
    return {"sample_cancel_enabled": False}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict:
    rt = runtime(request)
    return {"supported_models": [
        {"model_name": m, "trainable": True, "sampleable": True} for m in rt.config.models
    ]}


@router.post("/create_session")
async def create_session(request: Request) -> dict:
    rt = runtime(request)
    body = await json_body(request)
    return {"type": "create_session", "session_id": rt.create_session(body)}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> dict:
    rt = runtime(request)
    body = await json_body(request)
    if isinstance(body.get("session_id"), str):
        rt.store.heartbeat(body["session_id"])
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> dict:
    rt = runtime(request)
    body = await json_body(request)
    rt.finish_session(session_id, body.get("reason"))
    return {}


def _session_json(row: dict, rt) -> dict:
    runs = [r["run_id"] for r in rt.store.iter_runs() if r["session_id"] == row["session_id"]]
    return {"session_id": row["session_id"], "training_run_ids": runs, "sampler_ids": [],
            "created_at": iso(row["created_at"]), "finished_at": iso(row["finished_at"])}


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
    rt = runtime(request)
    rows, _ = rt.store.list_sessions(limit, offset)
    return {"sessions": [r["session_id"] for r in rows]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request):
    from fastapi.responses import JSONResponse

    rt = runtime(request)
    row = rt.store.session(session_id)
    if row is None:
        return JSONResponse({"detail": f"unknown session {session_id!r}"}, status_code=404)
    return _session_json(row, rt)


@router.post("/telemetry")
async def telemetry(request: Request) -> dict:
    await request.body()  # accepted and dropped
    return {"status": "accepted"}
