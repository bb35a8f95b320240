"""Benchmark 7: mixed precision (``dtype="bfloat16"``: fp32 masters, bf16 compute).

- **Loss drop**: the issue's case, 30 AdamW steps at lr 1e-5 on one batch of ``tiny``: how
  much the loss falls with bf16-mixed and with pure bf16 (``master_dtype="bfloat16"``),
  as a ratio of the fp32 drop, on the local engine and (full mode) the fsdp engine.
- **Step time**: forward_backward + optim_step, bf16-mixed and pure bf16 / fp32, interleaved,
  on the step benchmark's model.
- **Log-probabilities**: on the same weights, the bf16-mixed trainer's and a bf16 sampler's
  (the exported ``save_weights_for_sampler`` directory run by transformers) against fp32.
"""

from __future__ import annotations

import numpy as np

from .common import (
    ADAM,
    SdkSide,
    alternate,
    make_model_dir,
    make_sft_rows,
    num_parameters,
    ratio_summary,
    rows_to_datums,
    summary,
)
from .fsdp import available as fsdp_available

NAME = "mixed_precision"
TARGET_DROP = 0.9  # bf16-mixed loss drop >= 0.9 x the fp32 drop
MIXED = {"dtype": "bfloat16"}
PURE = {"dtype": "bfloat16", "master_dtype": "bfloat16"}


def loss_drop(engine: str, engine_config: dict, steps: int) -> float:
    from skyrl_sdk import Backend, types
    from skyrl_sdk.testing import make_sft_data

    data = make_sft_data([24, 31, 17, 40], seed=1)  # the batch of tests/test_precision.py
    adam = types.AdamParams(learning_rate=1e-5)
    with Backend(model="tiny", engine=engine, engine_config=engine_config) as backend:
        first = last = backend.forward_backward(data, "cross_entropy").metrics["loss:sum"]
        for _ in range(steps):
            backend.optim_step(adam)
            last = backend.forward_backward(data, "cross_entropy").metrics["loss:sum"]
    return first - last


def _drops(ctx, engine: str, extra: dict, steps: int) -> dict:
    fp32 = loss_drop(engine, extra, steps)
    mixed = loss_drop(engine, {**extra, **MIXED}, steps)
    pure = loss_drop(engine, {**extra, **PURE}, steps)
    out = {"fp32_drop": fp32, "mixed_drop": mixed, "pure_bf16_drop": pure,
           "mixed_ratio": mixed / fp32, "pure_bf16_ratio": pure / fp32}
    out["verdict"] = "met" if out["mixed_ratio"] >= TARGET_DROP else "NOT met"
    ctx.log(f"{NAME}/{engine}: drop ratio mixed {out['mixed_ratio']:.3f}, pure bf16 {out['pure_bf16_ratio']:.3f}")
    return out


def _logprob_gaps(model_dir, datums, workdir) -> dict:
    """Per-token |lp - lp_fp32| of the bf16-mixed trainer and of the bf16 sampler weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from skyrl_sdk import Backend

    def flat(out):
        return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])

    with Backend(model=str(model_dir)) as fp32:
        ref = flat(fp32.forward(datums, "cross_entropy"))
    with Backend(model=str(model_dir), engine_config=MIXED) as mixed:
        trainer = flat(mixed.forward(datums, "cross_entropy"))
        mixed.save_weights_for_sampler(workdir / "precision_sampler", overwrite=True)
    model = AutoModelForCausalLM.from_pretrained(str(workdir / "precision_sampler"))  # bf16 as exported
    sampler = []
    with torch.no_grad():
        for d in datums:
            ids = torch.as_tensor(d.model_input.to_ints()).unsqueeze(0)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            tgt = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            sampler.append(logp.gather(1, tgt.unsqueeze(-1)).squeeze(-1).numpy())
    sampler = np.concatenate(sampler)

    def gap(a, b):
        diff = np.abs(a - b)
        return {"max": float(diff.max()), "mean": float(diff.mean())}

    return {"exported_dtype": str(model.dtype).removeprefix("torch."), "tokens": int(ref.size),
            "mean_fp32_logprob": float(ref.mean()), "trainer_bf16_mixed_vs_fp32": gap(trainer, ref),
            "sampler_bf16_vs_fp32": gap(sampler, ref), "sampler_bf16_vs_trainer_bf16_mixed": gap(sampler, trainer)}


def run(ctx) -> dict:
    steps = 3 if ctx.smoke else 30
    out: dict = {"loss_drop": {"steps": steps, "learning_rate": 1e-5, "model": "tiny", "target": TARGET_DROP,
                               "local": _drops(ctx, "local", {}, steps)}}
    missing = fsdp_available()
    if ctx.smoke or missing:
        out["loss_drop"]["fsdp"] = {"status": "skipped in smoke mode" if ctx.smoke else missing}
    else:
        out["loss_drop"]["fsdp"] = _drops(ctx, "fsdp", {"world_size": 2, "threads_per_rank": 1}, steps)

    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    rows = make_sft_rows([32] * 2 if ctx.smoke else [256] * 8, spec["vocab"], seed=7)
    datums = rows_to_datums(rows)
    sides = {"fp32": SdkSide(model_dir, {}), "bf16_mixed": SdkSide(model_dir, MIXED),
             "bf16_pure": SdkSide(model_dir, PURE)}
    try:
        times, _ = alternate({k: (lambda s=s: s.step(datums)) for k, s in sides.items()},
                             reps=ctx.reps, warmup=ctx.warmup)
    finally:
        for s in sides.values():
            s.close()
    out["step_time"] = {
        "model": {**spec, "parameters": num_parameters(spec)}, "tokens": int(sum(len(r["tokens"]) for r in rows)),
        "adam": ADAM, "seconds": {k: summary(v) for k, v in times.items()},
        "mixed_over_fp32": ratio_summary(times["bf16_mixed"], times["fp32"]),
        "pure_over_fp32": ratio_summary(times["bf16_pure"], times["fp32"]),
    }
    ctx.log(f"{NAME}: step time mixed/fp32 {out['step_time']['mixed_over_fp32']['median']:.3f}")
    out["logprobs"] = _logprob_gaps(model_dir, datums[:2], ctx.workdir)
    return out


def targets(result: dict) -> list[dict]:
    rows = []
    for engine in ("local", "fsdp"):
        r = result["loss_drop"].get(engine, {})
        if "mixed_ratio" in r:
            v = r["mixed_ratio"]
            steps = result["loss_drop"]["steps"]
            metric = f"{engine}: bf16-mixed loss drop / fp32 drop ({steps} steps, lr 1e-5)"
            rows.append({"benchmark": NAME, "metric": metric,
                         "median": v, "min": v, "max": v, "target": TARGET_DROP, "target_op": ">=",
                         "verdict": r["verdict"]})
    s = result["step_time"]["mixed_over_fp32"]
    rows.append({"benchmark": NAME, "metric": "step time bf16-mixed / fp32, reported", "median": s["median"],
                 "min": s["min"], "max": s["max"], "target": None, "verdict": "reported"})
    return rows


def table(result: dict) -> list[str]:
    lines = ["| engine | fp32 drop | bf16-mixed drop (ratio) | pure bf16 drop (ratio) | target |",
             "|---|---|---|---|---|"]
    for engine in ("local", "fsdp"):
        r = result["loss_drop"].get(engine, {})
        if "mixed_ratio" not in r:
            lines.append(f"| {engine} | {r.get('status', '-')} | | | |")
            continue
        lines.append(f"| {engine} | {r['fp32_drop']:.3f} | {r['mixed_drop']:.3f} ({r['mixed_ratio']:.3f}) | "
                     f"{r['pure_bf16_drop']:.3f} ({r['pure_bf16_ratio']:.3f}) | >= {TARGET_DROP} ({r['verdict']}) |")
    st = result["step_time"]
    lines += ["", "| step time (s) | fp32 | bf16-mixed | pure bf16 | mixed / fp32 | pure / fp32 |",
              "|---|---|---|---|---|---|",
              f"| {st['tokens']} tokens | {st['seconds']['fp32']['median']:.3f} | "
              f"{st['seconds']['bf16_mixed']['median']:.3f} | {st['seconds']['bf16_pure']['median']:.3f} | "
              f"{st['mixed_over_fp32']['median']:.3f} ({st['mixed_over_fp32']['min']:.3f}-"
              f"{st['mixed_over_fp32']['max']:.3f}) | {st['pure_over_fp32']['median']:.3f} |"]
    lp = result["logprobs"]
    lines += ["", f"| logprob gap over {lp['tokens']} tokens | max | mean |", "|---|---|---|"]
    for key in ("trainer_bf16_mixed_vs_fp32", "sampler_bf16_vs_fp32", "sampler_bf16_vs_trainer_bf16_mixed"):
        lines.append(f"| {key} | {lp[key]['max']:.4f} | {lp[key]['mean']:.4f} |")
    return lines
