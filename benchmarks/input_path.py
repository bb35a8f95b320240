"""Benchmark 3: validating and converting a batch into packed tensors vs the step itself.

The input path is what ``forward_backward`` does before the model runs: ``coerce_data`` +
``validate_data`` + ``make_micro_batches`` + ``pack_inputs`` of every micro-batch. It is
timed from typed ``Datum`` objects (numpy-backed, the in-process path) and from Tinker JSON
dicts with Python lists (what a server request decodes to), and divided by the median
``forward_backward + optim_step`` time of the same batch on the same model.
"""

from __future__ import annotations

import time

from .common import SdkSide, check_verdict, make_model_dir, make_sft_rows, rows_to_datums, rows_to_json, summary

NAME = "input_path"
TARGET = 0.02


def input_path(backend, data) -> int:
    from skyrl_sdk.engines.batching import make_micro_batches, pack_inputs
    from skyrl_sdk.inputs.coerce import data_from_any
    from skyrl_sdk.losses.validation import validate_data

    runner = backend.engine.runner
    spec = backend.resolve("cross_entropy").spec
    datums = data_from_any(data)
    validate_data(datums, spec, backend.vocab_size)
    batches = make_micro_batches(datums, runner.micro_batch_tokens, runner.batching, runner.pad_id)
    for mb in batches:
        pack_inputs(datums, mb.datum_indices)
    return len(batches)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(ctx) -> dict:
    spec = ctx.model_spec
    n, length = (8, 64) if ctx.smoke else (64, 2048)
    rows = make_sft_rows([length] * n, spec["vocab"], seed=11)
    datums = rows_to_datums(rows)
    dicts = rows_to_json(rows)
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    sdk = SdkSide(model_dir, ctx.engine_config)
    try:
        backend = sdk.backend
        input_reps = 3 if ctx.smoke else 20
        # warm-up: a short batch (allocator, threads), then interleave the measurements
        sdk.step(datums[:2])
        typed, from_json, steps = [], [], []
        for _ in range(ctx.input_step_reps):
            typed += _time(lambda: input_path(backend, datums), input_reps)
            from_json += _time(lambda: input_path(backend, dicts), max(1, input_reps // 4))
            steps += _time(lambda: sdk.step(datums), 1)
        n_mb = input_path(backend, datums)
    finally:
        sdk.close()
    step = summary(steps)
    frac = summary([t / step["median"] for t in typed])
    frac_json = summary([t / step["median"] for t in from_json])
    ctx.log(f"{NAME}: {frac['median'] * 100:.2f}% of the step (from JSON lists: {frac_json['median'] * 100:.2f}%)")
    return {
        "datums": n,
        "tokens_per_datum": length,
        "micro_batches": n_mb,
        "input_path_s": summary(typed),
        "input_path_from_json_s": summary(from_json),
        "step_s": step,
        "fraction_of_step": frac,
        "fraction_of_step_from_json": frac_json,
        "target": TARGET,
        "verdict": check_verdict(frac["median"], TARGET),
    }


def table(result: dict) -> list[str]:
    f, fj = result["fraction_of_step"], result["fraction_of_step_from_json"]
    return [
        "| batch | input path ms (typed Datum) | from JSON lists ms | step s | fraction (typed) | fraction (JSON) | target |",
        "|---|---|---|---|---|---|---|",
        f"| {result['datums']} x {result['tokens_per_datum']} | {result['input_path_s']['median'] * 1e3:.1f} | "
        f"{result['input_path_from_json_s']['median'] * 1e3:.1f} | {result['step_s']['median']:.2f} | "
        f"{f['median'] * 100:.2f}% ({f['min'] * 100:.2f}-{f['max'] * 100:.2f}) | "
        f"{fj['median'] * 100:.2f}% ({fj['min'] * 100:.2f}-{fj['max'] * 100:.2f}) | "
        f"<= {result['target'] * 100:.0f}% ({result['verdict']}) |",
    ]
