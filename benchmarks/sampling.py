"""Benchmark: our sampler vs a plain ``generate()`` of the same batch (speed and peak memory).

Speed: both sides in one process, alternating, the same prompts, every row drawn to exactly
``new_tokens`` (``stop=[]`` / no EOS), temperature 1. Reported: tokens/s of each and the
per-repetition time ratio (SDK / generate; target <= 1.0, i.e. tokens/s >= 1.0x).
Memory: each side in a fresh process (``benchmarks.sampling_worker``): peak RSS (``VmHWM``
after ``clear_refs``) minus the RSS before the batch; target <= 0.5 GiB for the SDK.
"""

from __future__ import annotations

from .common import alternate, check_verdict, make_model_dir, num_parameters, ratio_summary, run_worker, summary
from .sampling_sides import PlainGenerate, SdkSampler, make_prompts

NAME = "sampling"
TARGET_TIME_RATIO = 1.0
TARGET_PEAK_GIB = 0.5


def sizes(smoke: bool) -> dict:
    if smoke:
        return {"prompts": 2, "samples": 2, "new_tokens": 8, "prompt_len": 8}
    return {"prompts": 8, "samples": 8, "new_tokens": 256, "prompt_len": 32}


def _memory(ctx, model_dir, side: str, size: dict) -> dict:
    return run_worker("benchmarks.sampling_worker", ["--model", str(model_dir), "--side", side,
           "--prompts", str(size["prompts"]), "--samples", str(size["samples"]),
           "--new-tokens", str(size["new_tokens"]), "--prompt-len", str(size["prompt_len"]),
           "--threads", str(ctx.threads)], "sampling")


def run(ctx) -> dict:
    spec = ctx.memory_spec  # vocabulary 32k (smoke: toy)
    size = sizes(ctx.smoke)
    model_dir = make_model_dir(ctx.workdir / "model_sampling", spec)
    prompts = make_prompts(size["prompts"], size["prompt_len"], spec["vocab"])
    sdk, plain = SdkSampler(model_dir), PlainGenerate(model_dir)
    n, t = size["samples"], size["new_tokens"]
    for side in (sdk, plain):  # warm-up with a short batch: the timed reps are the full one
        side.sample(prompts, n, min(t, 4))
    wall, cpu = alternate({"sdk": lambda: sdk.sample(prompts, n, t), "generate": lambda: plain.sample(prompts, n, t)},
                          reps=ctx.sampling_reps, warmup=0)
    tokens = size["prompts"] * n * t
    ratio = ratio_summary(wall["sdk"], wall["generate"])
    ctx.log(f"{NAME}: time ratio {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    mem = {side: _memory(ctx, model_dir, side, size) for side in ("sdk", "generate")}
    peak_gib = mem["sdk"]["peak_delta_bytes"] / 2**30
    return {
        "model": {**spec, "parameters": num_parameters(spec)},
        **size,
        "rows": size["prompts"] * n,
        "sdk_tokens_per_s": summary([tokens / s for s in wall["sdk"]]),
        "generate_tokens_per_s": summary([tokens / s for s in wall["generate"]]),
        "time_ratio": ratio,
        "cpu_time_ratio": ratio_summary(cpu["sdk"], cpu["generate"]),
        "target_time_ratio": TARGET_TIME_RATIO,
        "verdict_time": check_verdict(ratio["median"], TARGET_TIME_RATIO),
        "sdk_peak_growth_gib": peak_gib,
        "generate_peak_growth_gib": mem["generate"]["peak_delta_bytes"] / 2**30,
        "memory_method": "fresh process per side; VmHWM after clear_refs minus RSS before the batch",
        "target_peak_gib": TARGET_PEAK_GIB,
        "verdict_memory": check_verdict(peak_gib, TARGET_PEAK_GIB),
    }


def table(result: dict) -> list[str]:
    r = result
    return [
        "| batch (prompts x samples x new tokens, vocab) | SDK tok/s | generate() tok/s | time ratio SDK/generate "
        "median (min-max) | SDK peak growth GiB | generate() peak growth GiB |",
        "|---|---|---|---|---|---|",
        f"| {r['prompts']} x {r['samples']} x {r['new_tokens']} ({r['model']['vocab']}) | "
        f"{r['sdk_tokens_per_s']['median']:.0f} | {r['generate_tokens_per_s']['median']:.0f} | "
        f"{r['time_ratio']['median']:.3f} ({r['time_ratio']['min']:.3f}-{r['time_ratio']['max']:.3f}) "
        f"<= {r['target_time_ratio']} ({r['verdict_time']}) | {r['sdk_peak_growth_gib']:.3f} "
        f"<= {r['target_peak_gib']} ({r['verdict_memory']}) | {r['generate_peak_growth_gib']:.3f} |",
    ]
