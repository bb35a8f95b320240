"""Sampling routes: sampling sessions, sampler info, asample (results as protobuf)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .http import json_body, owner, runtime, submit

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    sid = runtime(request).create_sampling_session(owner(request), await json_body(request))
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> dict:
    return runtime(request).get_sampler(owner(request), sampler_id)


@router.post("/asample")
async def asample(request: Request) -> dict:
    return await submit(request, "asample")


@router.post("/cancel_future")
async def cancel_future(request: Request) -> dict:
    """Accepted and ignored: a sample already queued runs to the end (the client only sends
    this when the server's dynamic config enables it, which this one does not)."""
    await request.body()
    return {}
