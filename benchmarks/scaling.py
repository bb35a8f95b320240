"""Benchmark 6: SDK step time vs total tokens and vs sequence length at fixed tokens."""

from __future__ import annotations

import time

from .common import SdkSide, make_model_dir, make_sft_rows, rows_to_datums, summary

NAME = "scaling"


def grids(smoke: bool):
    if smoke:
        return {"tokens": [(64, 2), (64, 4)], "seq_len": [(32, 4), (64, 2)]}
    seq = 256
    tokens = [(seq, total // seq) for total in (1024, 2048, 4096, 8192, 16384, 32768)]
    fixed = 8192
    lengths = [(n, fixed // n) for n in (128, 256, 512, 1024, 2048, 4096)]
    return {"tokens": tokens, "seq_len": lengths}


def run(ctx) -> dict:
    spec = ctx.model_spec
    model_dir = make_model_dir(ctx.workdir / "model_step", spec)
    sdk = SdkSide(model_dir, ctx.engine_config)
    points = {kind: [(n, b) for n, b in grid] for kind, grid in grids(ctx.smoke).items()}
    data = {(n, b): rows_to_datums(make_sft_rows([n] * b, spec["vocab"], seed=n * 1000 + b))
            for grid in points.values() for n, b in grid}
    times: dict[tuple[int, int], list[float]] = {key: [] for key in data}
    try:
        sdk.step(data[min(data, key=lambda k: k[0] * k[1])])  # warm-up
        for _ in range(ctx.scaling_reps):  # repetitions outside, points inside: drift hits all points
            for key, datums in data.items():
                t0 = time.perf_counter()
                sdk.step(datums)
                times[key].append(time.perf_counter() - t0)
    finally:
        sdk.close()
    out = {"engine_config": dict(ctx.engine_config)}
    for kind, grid in points.items():
        rows = []
        for n, b in grid:
            s = summary(times[(n, b)])
            rows.append({"seq_len": n, "batch": b, "tokens": n * b, "step_s": s, "tokens_per_s": n * b / s["median"]})
        out[kind] = rows
    ctx.log(f"{NAME}: " + ", ".join(f"{r['tokens']}tok {r['step_s']['median']:.2f}s" for r in out["tokens"]))
    return out


def plot(result: dict, path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    x = [r["tokens"] for r in result["tokens"]]
    y = [r["step_s"]["median"] for r in result["tokens"]]
    err = [[r["step_s"]["median"] - r["step_s"]["min"] for r in result["tokens"]],
           [r["step_s"]["max"] - r["step_s"]["median"] for r in result["tokens"]]]
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="SDK step")
    ideal = [y[0] * t / x[0] for t in x]
    ax.plot(x, ideal, "--", color="grey", label="linear in tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(f"tokens per step (seq len {result['tokens'][0]['seq_len']})")
    ax.set_ylabel("seconds per step (fwd+bwd+AdamW)")
    ax.set_title("step time vs tokens")
    ax.legend()
    ax = axes[1]
    x = [r["seq_len"] for r in result["seq_len"]]
    y = [r["tokens_per_s"] for r in result["seq_len"]]
    ax.plot(x, y, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"sequence length ({result['seq_len'][0]['tokens']} tokens per step)")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput vs sequence length")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
    return str(path)


def table(result: dict) -> list[str]:
    lines = ["| kind | seq len x batch | tokens | s/step median (min-max) | tokens/s |", "|---|---|---|---|---|"]
    for kind in ("tokens", "seq_len"):
        for r in result[kind]:
            s = r["step_s"]
            lines.append(f"| {kind} | {r['seq_len']} x {r['batch']} | {r['tokens']} | "
                         f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | {r['tokens_per_s']:.0f} |")
    return lines
