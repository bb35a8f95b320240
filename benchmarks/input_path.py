"""Benchmark 3: validating and converting a batch into packed tensors vs the step itself.

The input path is what ``forward_backward`` does before the model runs: ``coerce_data`` +
``validate_data`` + ``make_micro_batches`` + ``pack_inputs`` of every micro-batch. It is
timed from typed ``Datum`` objects (numpy-backed, the in-process path), from Tinker JSON
dicts with Python lists (mappings given in process), and from the wire: the protobuf
``ForwardBackwardRequest`` the tinker client sends to ``skyrl-sdk serve``, decoded as the
server decodes it (``inputs.tinker_proto``); each divided by the median
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


def proto_body(rows) -> bytes | None:
    """The batch as the tinker client sends it to ``skyrl-sdk serve`` (None without tinker)."""
    try:
        from tinker import types as tt
        from tinker.proto.request_conv import forward_backward_request_to_proto
    except ImportError:
        return None
    from .server import rows_to_tinker

    request = tt.ForwardBackwardRequest(model_id="bench", forward_backward_input=tt.ForwardBackwardInput(
        data=rows_to_tinker(rows), loss_fn="cross_entropy"))
    return forward_backward_request_to_proto(request).SerializeToString()


def input_path_from_wire(backend, body: bytes) -> int:
    """The server's decoding of the body, then the same input path."""
    from skyrl_sdk.inputs.tinker_proto import forward_backward_from_proto

    return input_path(backend, forward_backward_from_proto(body, lambda model_id: None).data)


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
        body = proto_body(rows)
        if body is not None:
            input_path_from_wire(backend, body)  # its first call imports the decoder
        typed, from_json, from_wire, steps = [], [], [], []
        for _ in range(ctx.input_step_reps):
            typed += _time(lambda: input_path(backend, datums), input_reps)
            from_json += _time(lambda: input_path(backend, dicts), max(1, input_reps // 4))
            if body is not None:
                from_wire += _time(lambda: input_path_from_wire(backend, body), input_reps)
            steps += _time(lambda: sdk.step(datums), 1)
        n_mb = input_path(backend, datums)
    finally:
        sdk.close()
    step = summary(steps)
    frac = summary([t / step["median"] for t in typed])
    frac_json = summary([t / step["median"] for t in from_json])
    frac_wire = summary([t / step["median"] for t in from_wire]) if from_wire else None
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
        "input_path_from_wire_s": summary(from_wire) if from_wire else "not available (no tinker package)",
        "fraction_of_step_from_wire": frac_wire or "not available (no tinker package)",
        "target": TARGET,
        "verdict": check_verdict(frac["median"], TARGET),
    }


def table(result: dict) -> list[str]:
    f, fj, fw = result["fraction_of_step"], result["fraction_of_step_from_json"], result["fraction_of_step_from_wire"]

    def pct(x: dict | str) -> str:
        return f"{x['median'] * 100:.4f}% ({x['min'] * 100:.4f}-{x['max'] * 100:.4f}%)" if isinstance(x, dict) else x

    def ms(x: dict | str) -> str:
        return f"{x['median'] * 1e3:.1f}" if isinstance(x, dict) else "-"

    return [
        "| batch | input path ms (typed Datum) | from JSON lists ms | from the wire (protobuf) ms | step s | "
        "fraction (typed) | fraction (JSON) | fraction (wire) | target |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {result['datums']} x {result['tokens_per_datum']} | {ms(result['input_path_s'])} | "
        f"{ms(result['input_path_from_json_s'])} | {ms(result['input_path_from_wire_s'])} | "
        f"{result['step_s']['median']:.2f} | {pct(f)} | {pct(fj)} | {pct(fw)} | "
        f"<= {result['target'] * 100:.0f}% ({result['verdict']}) |",
    ]
