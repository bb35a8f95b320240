"""Benchmark 7: per-rank peak RSS of the fsdp engine (2 ranks) vs the local engine.

A ~100M-parameter Llama (random weights, written locally) goes through load + one
forward_backward + one optim_step. Each side runs in a fresh process
(``python -m benchmarks.fsdp_loading --worker local|fsdp``); the figure is each process's
peak RSS over its whole life (``VmHWM``: loading included, where a full copy per rank
would show). Reported raw and minus an idle interpreter that imported the same modules.
The peak after each phase (load, forward_backward, optim_step) shows which phase set it;
a second step follows, reported apart (the target is over load + one step).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from .common import (
    check_verdict,
    make_model_dir,
    make_sft_rows,
    num_parameters,
    proc_status,
    rows_to_datums,
    run_worker,
)

NAME = "fsdp_loading"
TARGET = 0.55
WORLD_SIZE = 2
#: ~106M parameters (untied 32k vocabulary, 8 layers of width 768).
MODEL_100M = dict(vocab=32000, hidden=768, intermediate=2048, layers=8, heads=12, kv_heads=4, tie=False)
MODEL_SMOKE = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tie=False)


def _worker(side: str, model: str, threads: int) -> dict:
    import torch

    import skyrl_sdk
    from skyrl_sdk import types

    torch.set_num_threads(threads)
    idle = proc_status("VmRSS", "self")  # interpreter + torch + transformers + skyrl_sdk imported
    datums = rows_to_datums(make_sft_rows([64] * 4, 256, seed=5))
    cfg = {"world_size": WORLD_SIZE, "threads_per_rank": threads} if side == "fsdp" else {}
    t0 = time.perf_counter()
    phases: dict[str, list[int]] = {}
    with skyrl_sdk.Backend(model=model, engine=side, engine_config=cfg) as b:
        pids = list(b.engine.rank_pids) if side == "fsdp" else [os.getpid()]

        def peaks_so_far(phase: str) -> None:  # VmHWM only grows: the phase that raised it shows
            phases[phase] = [proc_status("VmHWM", p) for p in pids]

        peaks_so_far("load")
        b.forward_backward(datums)
        peaks_so_far("forward_backward")
        b.optim_step(types.AdamParams(learning_rate=1e-4))
        peaks_so_far("optim_step")
        seconds = time.perf_counter() - t0
        b.forward_backward(datums)  # a second step: its moments exist before backward
        b.optim_step(types.AdamParams(learning_rate=1e-4))
        peaks_so_far("second_step")
    return {"side": side, "idle_rss_bytes": idle, "peak_rss_bytes": phases["optim_step"],
            "peak_rss_bytes_by_phase": phases, "seconds": seconds}


def _spawn(side: str, model_dir, threads: int) -> dict:
    return run_worker("benchmarks.fsdp_loading", ["--worker", side, "--model", str(model_dir),
           "--threads", str(threads)], f"{side}")


def run(ctx) -> dict:
    from .fsdp import available

    why = available()
    if why is not None:
        return {"status": why, "target": TARGET}
    spec = MODEL_SMOKE if ctx.smoke else MODEL_100M
    model_dir = make_model_dir(ctx.workdir / "model_fsdp_loading", spec)
    local = _spawn("local", model_dir, ctx.threads)
    fsdp = _spawn("fsdp", model_dir, ctx.threads)
    idle = local["idle_rss_bytes"]
    ratio = max(fsdp["peak_rss_bytes"]) / local["peak_rss_bytes"][0]
    net = (max(fsdp["peak_rss_bytes"]) - idle) / (local["peak_rss_bytes"][0] - idle)
    ctx.log(f"{NAME}: max rank peak RSS / local {ratio:.3f} (minus idle interpreter {net:.3f})")
    return {
        "status": "ok",
        "model": {**spec, "parameters": num_parameters(spec)},
        "world_size": WORLD_SIZE,
        "method": "fresh process per side; VmHWM over load + forward_backward + optim_step",
        "local": local,
        "fsdp": fsdp,
        "peak_ratio": ratio,
        "peak_ratio_minus_idle": net,
        "target": TARGET,
        "verdict": check_verdict(ratio, TARGET),
    }


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [f"{NAME}: {result.get('status')}"]
    mib = [p / 2**20 for p in result["fsdp"]["peak_rss_bytes"]]
    local = result["local"]["peak_rss_bytes"][0] / 2**20
    return [
        "| parameters | rank peak RSS MiB | local peak RSS MiB | idle MiB | ratio | minus idle | target |",
        "|---|---|---|---|---|---|---|",
        f"| {result['model']['parameters'] / 1e6:.0f}M | {', '.join(f'{m:.0f}' for m in mib)} | {local:.0f} | "
        f"{result['local']['idle_rss_bytes'] / 2**20:.0f} | {result['peak_ratio']:.3f} | "
        f"{result['peak_ratio_minus_idle']:.3f} | <= {result['target']} ({result['verdict']}) |",
        "",
        "| peak RSS MiB after | local | fsdp, largest rank |",
        "|---|---|---|",
        *(f"| {phase} | {result['local']['peak_rss_bytes_by_phase'][phase][0] / 2**20:.0f} | "
          f"{max(result['fsdp']['peak_rss_bytes_by_phase'][phase]) / 2**20:.0f} |"
          for phase in result["local"]["peak_rss_bytes_by_phase"]),
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["local", "fsdp"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from .common import set_threads

    print(json.dumps(_worker(args.worker, args.model, set_threads(args.threads))))


if __name__ == "__main__":
    main()
