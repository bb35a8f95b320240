"""Training routes: models, forward/backward (protobuf), optimizer, weights, futures."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .http import json_body, owner, runtime, submit

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request) -> dict:
    return await submit(request, "create_model")


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    return await runtime(request).get_info(owner(request), await json_body(request))


@router.post("/forward_backward")
async def forward_backward(request: Request) -> dict:
    """Protobuf ``ForwardBackwardRequest`` (``forward_only`` selects a forward pass)."""
    return await submit(request, "forward_backward")


@router.post("/optim_step")
async def optim_step(request: Request) -> dict:
    return await submit(request, "optim_step")


@router.post("/save_weights")
async def save_weights(request: Request) -> dict:
    return await submit(request, "save_weights")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> dict:
    return await submit(request, "save_weights_for_sampler")


@router.post("/load_weights")
async def load_weights(request: Request) -> dict:
    return await submit(request, "load_weights")


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll: the result once ready, else ``try_again`` after ``long_poll_s``."""
    answer = await runtime(request).retrieve(owner(request), await json_body(request))
    if isinstance(answer, dict):
        return JSONResponse(answer)
    return Response(content=answer.body, media_type=answer.media_type)
