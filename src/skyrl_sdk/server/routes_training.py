"""Training routes: models, forward/backward (protobuf), optimizer, weights, futures."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import InputError
from . import wire
from .futures import Result
from .http import future_json, json_body, runtime, submit

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request) -> dict:
    return await submit(request, lambda rt, body: rt.create_model(body))


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    body = await json_body(request)
    return await runtime(request).get_info(body.get("model_id"))


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict:
    """Protobuf ``ForwardBackwardRequest`` (``forward_only`` selects a forward pass)."""
    rt = runtime(request)
    raw = await request.body()
    try:
        if "json" in request.headers.get("content-type", ""):
            raise InputError("forward_backward: send a protobuf ForwardBackwardRequest "
                             "(Content-Type: application/x-protobuf)")
        req = wire.parse_forward_backward(raw)
    except InputError as exc:
        rec = rt.futures.create(None)
        rt.futures.finish(rec, Result.from_exception(exc))
        return future_json(rec)
    return future_json(rt.forward_backward(req))


@router.post("/optim_step")
async def optim_step(request: Request) -> dict:
    return await submit(request, lambda rt, body: rt.optim_step(body))


@router.post("/save_weights")
async def save_weights(request: Request) -> dict:
    return await submit(request, lambda rt, body: rt.save_weights(body))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict:
    return await submit(request, lambda rt, body: rt.save_weights_for_sampler(body))


@router.post("/load_weights")
async def load_weights(request: Request) -> dict:
    return await submit(request, lambda rt, body: rt.load_weights(body))


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll: the result once ready, else ``try_again`` after ``long_poll_s``."""
    rt = runtime(request)
    body = await json_body(request)
    request_id = body.get("request_id")
    rec, result = await rt.futures.wait(request_id, rt.config.long_poll_s) if isinstance(request_id, str) \
        else (None, None)
    if rec is None:
        return JSONResponse({
            "error": f"unknown request_id {request_id!r}: this server has no such request (requests in flight "
                     f"are lost when the server restarts)",
            "category": "server",
        })
    if result is None:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    return Response(content=result.body, media_type=result.media_type)
