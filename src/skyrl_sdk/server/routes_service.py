"""Service routes: health, client config, sessions, telemetry, capabilities."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .http import json_body, owner, runtime

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


@router.get("/loaded")
async def loaded(request: Request) -> dict:
    """What is loaded: shared bases with their LoRA adapters (bytes, offloaded), own copies, memory."""
    return runtime(request).loaded(owner(request))


@router.post("/create_session")
async def create_session(request: Request) -> dict:
    sid = runtime(request).sessions.create(owner(request), await json_body(request))
    return {"type": "create_session", "session_id": sid}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request):
    ended = runtime(request).sessions.heartbeat(owner(request), await json_body(request))
    if ended is not None:
        return JSONResponse({"detail": ended}, status_code=410)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> dict:
    body = await json_body(request)
    runtime(request).sessions.finish(owner(request), session_id, body.get("reason"))
    return {}


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = 20, offset: int = 0) -> dict:
    return runtime(request).sessions.list(owner(request), limit, offset)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict:
    return runtime(request).sessions.get(owner(request), session_id)


@router.post("/telemetry")
async def telemetry(request: Request) -> dict:
    await request.body()  # accepted and dropped
    return {"status": "accepted"}
