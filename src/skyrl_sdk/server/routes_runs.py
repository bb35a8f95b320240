"""Training runs and their checkpoints (what the RestClient and the cookbook use)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .http import json_body, owner, runtime

router = APIRouter(prefix="/api/v1")


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
    return runtime(request).catalog.runs(owner(request), limit, offset)


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request) -> dict:
    return runtime(request).catalog.run(owner(request), run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request) -> dict:
    return runtime(request).catalog.checkpoints(owner(request), run_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict:
    runtime(request).catalog.delete_checkpoint(owner(request), run_id, checkpoint_id)
    return {}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
    return runtime(request).catalog.checkpoints(owner(request), None, limit, offset)


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    return runtime(request).catalog.weights_info(owner(request), await json_body(request))
