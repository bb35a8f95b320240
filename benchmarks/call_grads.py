"""Benchmark: what keeping the pending gradients through a failed call costs (issue 21).

``engine_config["keep_grads_on_error"]`` (default true) keeps each ``forward_backward``'s
gradients apart from the pending ones until it succeeds (``skyrl_sdk/engines/call_grads.py``);
false accumulates in place and a failure drops every pending gradient. Both settings, side
by side in one run, for a full fine-tune and a rank-16 LoRA of the same model:

- time: one training step of ``CALLS`` ``forward_backward`` calls (all but the first on top
  of pending gradients) and an ``optim_step``, the two settings alternating (ABBA);
- memory: the peak RSS growth of one ``forward_backward`` on top of pending gradients, each
  setting in a fresh process (``VmHWM`` after ``clear_refs``; glibc told to return freed
  blocks at once, so RSS follows live memory), next to the gradients' size, for a call of few
  tokens (the gradients dominate its peak) and of many (its activations do: the call's
  gradients grow while backward frees them).
"""

from __future__ import annotations

import json

from .call_grads_worker import measure
from .common import (
    ADAM,
    alternate,
    make_model_dir,
    make_sft_rows,
    num_parameters,
    ratio_summary,
    rows_to_datums,
    run_worker,
    summary,
)

NAME = "pending_grads"
#: forward_backward calls per optim_step (gradient accumulation)
CALLS = 4
CASES = {"full fine-tune": None, "LoRA rank 16": {"rank": 16}}
SETTINGS = {"keep": True, "drop": False}
#: large blocks mmap'ed and unmapped when freed: the peak RSS is the peak of live memory
LIVE_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _call_size(smoke: bool) -> tuple[int, int]:
    """(datums, tokens each) of one call of the timed step."""
    return (2, 16) if smoke else (2, 128)


def _memory_sizes(smoke: bool) -> dict[str, tuple[int, int]]:
    return {"few tokens": (1, 8), "many tokens": (2, 32)} if smoke else {"few tokens": (2, 16),
                                                                          "many tokens": (2, 512)}


def _backend(model_dir, lora, keep: bool):
    from skyrl_sdk import Backend

    return Backend(model=str(model_dir), lora=lora, engine_config={"keep_grads_on_error": keep})


def _step(backend, calls, adam) -> None:
    for datums in calls:
        backend.forward_backward(datums, "cross_entropy")
    backend.optim_step(adam)


def _time(ctx, model_dir, spec) -> dict:
    from skyrl_sdk import types

    batch, seq = _call_size(ctx.smoke)
    calls = [rows_to_datums(make_sft_rows([seq] * batch, spec["vocab"], seed=11 + i)) for i in range(CALLS)]
    adam = types.AdamParams(**ADAM)
    out = {}
    for case, lora in CASES.items():
        backends = {name: _backend(model_dir, lora, keep) for name, keep in SETTINGS.items()}
        try:
            wall, cpu = alternate({name: (lambda b=b: _step(b, calls, adam)) for name, b in backends.items()},
                                  reps=ctx.reps, warmup=ctx.warmup)
        finally:
            for b in backends.values():
                b.close()
        out[case] = {"step_s": {name: summary(wall[name]) for name in SETTINGS},
                     "time_ratio": ratio_summary(wall["keep"], wall["drop"]),
                     "cpu_ratio": ratio_summary(cpu["keep"], cpu["drop"])}
    return out


def _memory(ctx, model_dir) -> dict:
    """Peak growth per (case, size, setting): each in a fresh process, the settings' order
    alternating; smoke mode: all in this process (checks the path, not a measurement)."""
    runs = [(case, size, name) for case in CASES for size in _memory_sizes(ctx.smoke) for name in SETTINGS]

    def worker(chosen):
        runs = [[CASES[case], SETTINGS[name], *_memory_sizes(ctx.smoke)[size]] for case, size, name in chosen]
        if ctx.smoke:  # in this process: the code path, without a second interpreter's start-up
            return [measure(str(model_dir), *run) for run in runs]
        return run_worker("benchmarks.call_grads_worker", [
            "--model", str(model_dir), "--threads", str(ctx.threads), "--runs", json.dumps(runs),
        ], "pending_grads memory", env=LIVE_RSS)

    found: dict[tuple, list[dict]] = {run: [] for run in runs}
    batches = [runs] if ctx.smoke else [[run] for rep in range(ctx.memory_reps)
                                        for run in (runs if rep % 2 == 0 else runs[::-1])]
    for chosen in batches:
        for run, result in zip(chosen, worker(chosen), strict=True):
            found[run].append(result)
    out: dict[str, dict] = {}
    for case in CASES:
        for size, (batch, seq) in _memory_sizes(ctx.smoke).items():
            grad_mib = found[(case, size, "keep")][0]["grad_bytes"] / 2**20
            mib = {n: [m["peak_delta_bytes"] / 2**20 for m in found[(case, size, n)]] for n in SETTINGS}
            extra = [k - d for k, d in zip(mib["keep"], mib["drop"], strict=True)]
            out.setdefault(case, {})[size] = {
                "tokens": batch * seq, "gradient_mib": grad_mib,
                "peak_growth_mib": {n: summary(mib[n]) for n in SETTINGS},
                "extra_mib": summary(extra), "extra_per_gradient_buffer": summary([e / grad_mib for e in extra]),
            }
    return out


def run(ctx) -> dict:
    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    batch, seq = _call_size(ctx.smoke)
    times, memory = _time(ctx, model_dir, spec), _memory(ctx, model_dir)
    cases = {case: {**times[case], "memory": memory[case]} for case in CASES}
    for case, r in cases.items():
        extra = ", ".join(f"{size}: {m['extra_mib']['median']:.1f} MiB extra" for size, m in r["memory"].items())
        ctx.log(f"{NAME} {case}: time ratio {r['time_ratio']['median']:.3f}; {extra}")
    return {"model": {**spec, "parameters": num_parameters(spec)}, "calls_per_step": CALLS,
            "tokens_per_call": batch * seq, "cases": cases,
            "memory_method": "fresh process per setting; VmHWM after clear_refs minus RSS, the second call; "
                             "MALLOC_MMAP_THRESHOLD_=65536" if not ctx.smoke else "smoke: in the suite's process"}


def table(result: dict) -> list[str]:
    rows = ["| case | step keep / drop (min-max) | call | gradients MiB | peak growth keep / drop MiB | "
            "extra / gradients |", "|---|---|---|---|---|---|"]
    for case, r in result["cases"].items():
        t = r["time_ratio"]
        for m in r["memory"].values():
            e = m["extra_per_gradient_buffer"]
            rows.append(f"| {case} | {t['median']:.3f} ({t['min']:.3f}-{t['max']:.3f}) | {m['tokens']} tokens | "
                        f"{m['gradient_mib']:.1f} | {m['peak_growth_mib']['keep']['median']:.1f} / "
                        f"{m['peak_growth_mib']['drop']['median']:.1f} | {e['median']:.2f} ({e['min']:.2f}-"
                        f"{e['max']:.2f}) |")
    return rows
