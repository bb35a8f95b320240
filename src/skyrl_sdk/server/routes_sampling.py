"""Sampling routes: sampling sessions, sampler info, asample (results as protobuf)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .futures import Result
from .http import json_body, runtime
from ..errors import InputError

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    rt = runtime(request)
    body = await json_body(request)
    return {"type": "create_sampling_session", "sampling_session_id": rt.create_sampling_session(body)}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> dict:
    s = runtime(request).sampler(sampler_id)
    return {"sampler_id": s.sid, "base_model": s.base_model, "model_path": s.model_path}


@router.post("/asample")
async def asample(request: Request) -> dict:
    rt = runtime(request)
    try:
        body = await json_body(request)
    except InputError as exc:
        rec = rt.futures.create(None, prefix="sample")
        rt.futures.finish(rec, Result.from_exception(exc))
        return {"request_id": rec.request_id, "model_id": None, "sample_sequence_ids": []}
    rec, n = rt.sample(body)
    return {"request_id": rec.request_id, "model_id": None,
            "sample_sequence_ids": [f"{rec.request_id}:{i}" for i in range(n)]}


@router.post("/cancel_future")
async def cancel_future(request: Request) -> dict:
    """Accepted and ignored: a sample already queued runs to the end (the client only sends
    this when the server's dynamic config enables it, which this one does not)."""
    await request.body()
    return {}
