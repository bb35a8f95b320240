"""Training runs and their checkpoints (what the RestClient and the cookbook use)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .http import json_body, runtime
from .runtime import UnknownError
from .store import TinkerPath, check_run_id, iso

router = APIRouter(prefix="/api/v1")


def _run_json(rt, run: dict) -> dict:
    lora = run["lora"]
    return {
        "training_run_id": run["run_id"],
        "base_model": run["base_model"],
        "model_owner": "local",
        "is_lora": lora is not None,
        "corrupted": False,
        "lora_rank": lora["rank"] if lora else None,
        "last_request_time": iso(run["last_request_time"]),
        "last_checkpoint": rt.store.last_checkpoint(run["run_id"], "training"),
        "last_sampler_checkpoint": rt.store.last_checkpoint(run["run_id"], "sampler"),
        "user_metadata": {str(k): str(v) for k, v in (run["user_metadata"] or {}).items()} or None,
    }


def _run(rt, run_id: str) -> dict:
    run = rt.store.run(check_run_id(run_id))
    if run is None:
        raise UnknownError(f"unknown training run {run_id!r}")
    return run


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict:
    rt = runtime(request)
    runs, total = rt.store.list_runs(max(0, limit), max(0, offset))
    return {"training_runs": [_run_json(rt, r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request) -> dict:
    rt = runtime(request)
    return _run_json(rt, _run(rt, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request) -> dict:
    rt = runtime(request)
    _run(rt, run_id)
    checkpoints, _ = rt.store.list_checkpoints(run_id)
    return {"checkpoints": checkpoints, "cursor": None}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
    rt = runtime(request)
    tp = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}")
    if not rt.store.delete_checkpoint(tp):
        return JSONResponse({"detail": f"no checkpoint {tp} on this server"}, status_code=404)
    return JSONResponse({})


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict:
    rt = runtime(request)
    checkpoints, total = rt.store.list_checkpoints(None, max(0, limit), max(0, offset))
    return {"checkpoints": checkpoints, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    rt = runtime(request)
    body = await json_body(request)
    tp, _ = rt.store.resolve_checkpoint(body.get("tinker_path"))
    run = _run(rt, tp.run_id)
    lora = run["lora"]
    out = {"base_model": run["base_model"], "is_lora": lora is not None}
    if lora:
        out.update(lora_rank=lora["rank"], train_unembed=lora["train_unembed"], train_mlp=lora["train_mlp"],
                   train_attn=lora["train_attn"])
    return out
