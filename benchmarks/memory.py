"""Benchmark 2: peak memory of one forward_backward at long sequences vs the hand loop.

Each side runs in a fresh process (``python -m benchmarks.memory_worker``): load the model,
reset the kernel's peak-RSS mark (``/proc/self/clear_refs``), run one forward+backward,
read the peak (``VmHWM``). Reported: peak minus the RSS after model load. On CUDA the
allocator's peak (``torch.cuda.max_memory_allocated``) would be the equivalent.
"""

from __future__ import annotations

import json

from .common import check_verdict, make_model_dir, num_parameters, run_worker, summary

NAME = "peak_memory"
TARGET = 0.5


def _worker(ctx, sides, model_dir, batch, seq) -> list[dict]:
    return run_worker("benchmarks.memory_worker", [
        "--model", str(model_dir), "--batch", str(batch), "--seq", str(seq), "--threads", str(ctx.threads),
        "--sides", ",".join(sides), "--engine-config", json.dumps(ctx.engine_config),
    ], "memory")


def run(ctx) -> dict:
    spec = ctx.memory_spec
    batch, seq = (2, 64) if ctx.smoke else (4, 2048)
    model_dir = make_model_dir(ctx.workdir / "model_memory", spec)
    samples: dict[str, list[dict]] = {"sdk": [], "hand": []}
    if ctx.smoke:
        # one process, peak reset between the sides: checks the path, not a measurement
        for res in _worker(ctx, ["sdk", "hand"], model_dir, batch, seq):
            samples[res["side"]].append(res)
    else:
        for rep in range(ctx.memory_reps):
            for side in (["sdk", "hand"] if rep % 2 == 0 else ["hand", "sdk"]):
                samples[side].extend(_worker(ctx, [side], model_dir, batch, seq))
    mib = {side: [s["peak_delta_bytes"] / 2**20 for s in samples[side]] for side in samples}
    ratios = [a / b for a, b in zip(mib["sdk"], mib["hand"], strict=True)]
    ratio = summary(ratios)
    ctx.log(f"{NAME}: ratio {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    logits_mib = batch * seq * spec["vocab"] * 4 / 2**20
    return {
        "model": {**spec, "parameters": num_parameters(spec)},
        "batch": batch,
        "seq_len": seq,
        "method": "fresh process per side; VmHWM after clear_refs minus RSS after model load"
        if not ctx.smoke else "smoke: one process, peak reset between sides",
        "fp32_logits_mib": logits_mib,
        "sdk_peak_mib": summary(mib["sdk"]),
        "hand_peak_mib": summary(mib["hand"]),
        "sdk_seconds": summary([s["seconds"] for s in samples["sdk"]]),
        "hand_seconds": summary([s["seconds"] for s in samples["hand"]]),
        "ratio": ratio,
        "target": TARGET,
        "verdict": check_verdict(ratio["median"], TARGET),
    }


def table(result: dict) -> list[str]:
    return [
        "| batch x seq (vocab) | SDK peak MiB | hand peak MiB | ratio median (min-max) | target |",
        "|---|---|---|---|---|",
        f"| {result['batch']} x {result['seq_len']} ({result['model']['vocab']}) | "
        f"{result['sdk_peak_mib']['median']:.0f} | {result['hand_peak_mib']['median']:.0f} | "
        f"{result['ratio']['median']:.3f} ({result['ratio']['min']:.3f}-{result['ratio']['max']:.3f}) | "
        f"<= {result['target']} ({result['verdict']}) |",
    ]
