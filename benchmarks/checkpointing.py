"""Benchmark 8: activation checkpointing (``gradient_checkpointing: true``) at 4 x 2048 tokens.

The peak-memory benchmark's method and model (fresh process per side, alternating; peak
RSS over the RSS after model load, one forward_backward), with and without checkpointing;
the same worker's wall time of that forward_backward gives the compute it costs.
"""

from __future__ import annotations

import json

from .common import make_model_dir, make_sft_rows, num_parameters, ratio_summary, run_worker, summary

NAME = "activation_checkpointing"
SIDES = {"plain": {}, "checkpointed": {"gradient_checkpointing": True}}


def _worker(ctx, model_dir, batch, seq, engine_config) -> dict:
    return run_worker("benchmarks.memory_worker", ["--model", str(model_dir), "--batch", str(batch),
           "--seq", str(seq), "--threads", str(ctx.threads), "--sides", "sdk",
           "--engine-config", json.dumps({**ctx.engine_config, **engine_config})], "memory")[0]


def _in_process(ctx, model_dir, batch, seq, engine_config) -> dict:
    """Smoke mode: this process, peak reset before the side (checks the path, not a measurement)."""
    from .memory_worker import measure

    rows = make_sft_rows([seq] * batch, ctx.memory_spec["vocab"], seed=3)
    return measure("sdk", str(model_dir), rows, {**ctx.engine_config, **engine_config})


def run(ctx) -> dict:
    spec = ctx.memory_spec
    batch, seq = (2, 64) if ctx.smoke else (4, 2048)
    model_dir = make_model_dir(ctx.workdir / "model_memory", spec)
    samples: dict[str, list[dict]] = {side: [] for side in SIDES}
    one = _in_process if ctx.smoke else _worker
    for rep in range(ctx.memory_reps):
        for side in (list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]):
            samples[side].append(one(ctx, model_dir, batch, seq, SIDES[side]))
    # smoke: one process, where a 2 x 64 call can run in pages freed earlier (a peak delta of 0):
    # floored at one page so the ratio is defined; the full run measures each side in its own process
    floor = 4096 if ctx.smoke else 0
    mib = {s: [max(r["peak_delta_bytes"], floor) / 2**20 for r in samples[s]] for s in SIDES}
    secs = {s: [r["seconds"] for r in samples[s]] for s in SIDES}
    ratio = ratio_summary(mib["checkpointed"], mib["plain"])
    ctx.log(f"{NAME}: peak ratio {ratio['median']:.3f}, time ratio "
            f"{ratio_summary(secs['checkpointed'], secs['plain'])['median']:.3f}")
    return {
        "model": {**spec, "parameters": num_parameters(spec)}, "batch": batch, "seq_len": seq,
        "method": "fresh process per side, alternating; VmHWM after clear_refs minus RSS after model load"
        if not ctx.smoke else "smoke: one process, peak reset between sides",
        "peak_mib": {s: summary(mib[s]) for s in SIDES},
        "forward_backward_s": {s: summary(secs[s]) for s in SIDES},
        "peak_ratio": ratio,
        "saved_mib": summary([p - c for p, c in zip(mib["plain"], mib["checkpointed"], strict=True)]),
        "time_ratio": ratio_summary(secs["checkpointed"], secs["plain"]),
    }


def targets(result: dict) -> list[dict]:
    r, t = result["peak_ratio"], result["time_ratio"]
    return [
        {"benchmark": NAME, "metric": "peak memory of forward_backward, checkpointed / plain", "median": r["median"],
         "min": r["min"], "max": r["max"], "target": 1.0, "target_op": "<",
         "verdict": "met" if r["median"] < 1.0 else "NOT met"},
        {"benchmark": NAME, "metric": "forward_backward time, checkpointed / plain, reported", "median": t["median"],
         "min": t["min"], "max": t["max"], "target": None, "verdict": "reported"},
    ]


def table(result: dict) -> list[str]:
    p, s = result["peak_mib"], result["forward_backward_s"]
    r, t = result["peak_ratio"], result["time_ratio"]
    return [
        "| batch x seq (vocab, layers) | plain peak MiB | checkpointed peak MiB | ratio median (min-max) | "
        "plain s | checkpointed s | time ratio |",
        "|---|---|---|---|---|---|---|",
        f"| {result['batch']} x {result['seq_len']} ({result['model']['vocab']}, {result['model']['layers']}) | "
        f"{p['plain']['median']:.0f} | {p['checkpointed']['median']:.0f} | "
        f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | {s['plain']['median']:.2f} | "
        f"{s['checkpointed']['median']:.2f} | {t['median']:.3f} ({t['min']:.3f}-{t['max']:.3f}) |",
    ]
