"""Benchmark 5: the FSDP engine (plugin ``skyrl-sdk-fsdp``) with 2 ranks vs the local engine.

Per-rank memory is parameter + optimizer-state bytes held by each rank after a step (the
engine's ``memory()`` report; the local engine's are counted the same way); the step-time
ratio (fsdp / local, interleaved) is reported as measured: on a 2-core CPU machine two
ranks share the cores and add collectives, so FSDP is expected to be slower there.
"""

from __future__ import annotations

from .common import (
    SdkSide,
    alternate,
    check_verdict,
    make_model_dir,
    make_sft_rows,
    num_parameters,
    ratio_summary,
    rows_to_datums,
    summary,
)

NAME = "fsdp"
TARGET_MEMORY = 0.6
WORLD_SIZE = 2


def available() -> str | None:
    try:
        from skyrl_sdk import get_registry

        engines = get_registry().engines
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"
    if "fsdp" not in engines:
        return "not available (engine 'fsdp' is not registered: pip install -e plugins/skyrl-sdk-fsdp)"
    return None


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def local_memory(backend) -> dict:
    """The local engine's parameter / optimizer bytes, counted like the fsdp ranks count theirs."""
    runner = backend.engine.runner
    params, seen = 0, set()
    for p in backend.engine.loaded.module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += _local_bytes(p)
    return {"rank": 0, "param_bytes": params, "optimizer_bytes": runner.optimizer.state_bytes()}


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why, "target_memory": TARGET_MEMORY}
    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    lengths = [32] * 4 if ctx.smoke else [256] * 8
    datums = rows_to_datums(make_sft_rows(lengths, spec["vocab"], seed=9))
    cfg = {k: v for k, v in ctx.engine_config.items() if k != "world_size"}
    local = SdkSide(model_dir, cfg)
    from skyrl_sdk import Backend

    fsdp = SdkSide.__new__(SdkSide)
    fsdp.backend = Backend(model=str(model_dir), engine="fsdp",
                           engine_config={**cfg, "world_size": WORLD_SIZE, "threads_per_rank": ctx.threads})
    fsdp.adam = local.adam
    import torch

    # same cores for both sides: the ranks get ``threads`` each, the local engine all of them
    local_threads = ctx.threads * WORLD_SIZE

    def local_step():
        torch.set_num_threads(local_threads)
        try:
            local.step(datums)
        finally:
            torch.set_num_threads(ctx.threads)

    try:
        times, _ = alternate({"fsdp": lambda: fsdp.step(datums), "local": local_step},
                             reps=ctx.fsdp_reps, warmup=max(1, ctx.warmup))
        ranks = fsdp.backend.engine.memory()
        base = local_memory(local.backend)
    finally:
        fsdp.close()
        local.close()
    per_rank = [r["param_bytes"] + r["optimizer_bytes"] for r in ranks]
    local_total = base["param_bytes"] + base["optimizer_bytes"]
    mem_ratio = max(per_rank) / local_total
    step = ratio_summary(times["fsdp"], times["local"])
    ctx.log(f"{NAME}: per-rank memory {mem_ratio:.3f}x, step time {step['median']:.2f}x")
    return {
        "status": "ok",
        "model": {**spec, "parameters": num_parameters(spec)},
        "world_size": WORLD_SIZE,
        "threads_per_rank": ctx.threads,
        "local_threads": local_threads,
        "batch_lengths": lengths,
        "per_rank": ranks,
        "local": base,
        "memory_ratio": mem_ratio,
        "target_memory": TARGET_MEMORY,
        "verdict_memory": check_verdict(mem_ratio, TARGET_MEMORY),
        "fsdp_s": summary(times["fsdp"]),
        "local_s": summary(times["local"]),
        "step_time_ratio": step,
    }


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [f"fsdp: {result.get('status')}"]
    s = result["step_time_ratio"]
    mib = [(r["param_bytes"] + r["optimizer_bytes"]) / 2**20 for r in result["per_rank"]]
    local = (result["local"]["param_bytes"] + result["local"]["optimizer_bytes"]) / 2**20
    return [
        "| ranks | per-rank params+optimizer MiB | local MiB | memory ratio | target | step-time ratio median (min-max) |",
        "|---|---|---|---|---|---|",
        f"| {result['world_size']} | {', '.join(f'{m:.1f}' for m in mib)} | {local:.1f} | "
        f"{result['memory_ratio']:.3f} | <= {result['target_memory']} ({result['verdict_memory']}) | "
        f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |",
    ]
