"""Benchmark 1: forward_backward(cross_entropy) + optim_step vs the hand-written loop."""

from __future__ import annotations

import numpy as np

from .common import (
    HandLoop,
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

NAME = "step_time"
TARGETS = {"variable": 0.5, "uniform": 1.03}


def cases(smoke: bool):
    rng = np.random.default_rng(1234)
    if smoke:
        return {"variable": rng.integers(8, 33, 4).tolist(), "uniform": [32] * 2}
    return {"variable": rng.integers(16, 385, 16).tolist(), "uniform": [256] * 8}


def run(ctx) -> dict:
    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    hand = HandLoop(model_dir)
    sdk = SdkSide(model_dir, ctx.engine_config)
    out = {
        "model": {**spec, "parameters": num_parameters(spec)},
        "engine_config": dict(ctx.engine_config),
        "cases": {},
    }
    try:
        for case, lengths in cases(ctx.smoke).items():
            rows = make_sft_rows(lengths, spec["vocab"], seed=7)
            datums = rows_to_datums(rows)
            times, cpu = alternate(
                {"sdk": lambda datums=datums: sdk.step(datums), "hand": lambda rows=rows: hand.step(rows)},
                reps=ctx.reps, warmup=ctx.warmup,
            )
            ratio = ratio_summary(times["sdk"], times["hand"])
            cpu_ratio = ratio_summary(cpu["sdk"], cpu["hand"])
            real = int(sum(lengths))
            out["cases"][case] = {
                "lengths": [int(n) for n in lengths],
                "real_tokens": real,
                "padded_tokens": int(max(lengths) * len(lengths)),
                "sdk_s": summary(times["sdk"]),
                "hand_s": summary(times["hand"]),
                "sdk_tokens_per_s": real / summary(times["sdk"])["median"],
                "hand_tokens_per_s": real / summary(times["hand"])["median"],
                "ratio": ratio,
                "cpu_ratio": cpu_ratio,
                "target": TARGETS[case],
                "verdict": check_verdict(ratio["median"], TARGETS[case]),
            }
            ctx.log(f"{NAME}/{case}: ratio {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}), "
                    f"CPU-time ratio {cpu_ratio['median']:.3f}")
    finally:
        sdk.close()
    return out


def table(result: dict) -> list[str]:
    lines = [
        "| case | real / padded tokens | SDK s/step | hand s/step | ratio median (min-max) | CPU-time ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, c in result["cases"].items():
        lines.append(
            f"| {case} | {c['real_tokens']} / {c['padded_tokens']} | {c['sdk_s']['median']:.3f} | "
            f"{c['hand_s']['median']:.3f} | {c['ratio']['median']:.3f} ({c['ratio']['min']:.3f}-{c['ratio']['max']:.3f}) "
            f"| {c['cpu_ratio']['median']:.3f} ({c['cpu_ratio']['min']:.3f}-{c['cpu_ratio']['max']:.3f}) "
            f"| <= {c['target']} ({c['verdict']}) |"
        )
    return lines
