"""Benchmark: the training phase of an RL step on GRPO-shaped batches, with prefix sharing on,
off, and in a padded hand-written loop.

A batch is ``prompts`` random prompts of ``P`` tokens, each with ``G`` random completions of
8-48 tokens (weights 0 on the prompt, 1 on the completion). Each side runs
``forward_backward(cross_entropy)`` + ``optim_step`` on the same weights and data, alternated
(``common.alternate``), one thread:

- ``shared``: ``Backend`` with prefix sharing (the default);
- ``unshared``: ``Backend`` with ``prefix_sharing: false`` (the bucket layout);
- ``hand``: ``common.HandLoop``: pad to the longest row, forward, log-softmax + gather,
  backward, AdamW (only on the headline batch: it is the slowest side).

Reported: the headline batch (the issue's: 4 prompts x 320 tokens x 8 completions), shared /
hand (target <= 0.40) and shared / unshared; a batch whose prompts are shorter than
``prefix_sharing_min_tokens`` (benchmarks.grpo's: 5 tokens, nothing to share), sharing on
against off: what the grouping costs when it finds nothing; the headline batch through ``skyrl-sdk serve`` and
the tinker client (a rank-8 LoRA client, the server's defaults), against a server started
with ``--engine-config '{"prefix_sharing": false}'``: the servers' CPU seconds per step; the speedup unshared / shared against the prompt
length (G = 8) and the group size (P = 256), the shared side sharing any common head
(``prefix_sharing_min_tokens: 1``, and no minimum saving: ``MIN_SAVED_FRACTION = 0``) so that
the break-even shows. Speedups are ratios of CPU seconds (this process's: insensitive to
other jobs on a shared machine), each pair measured back to back.

    python -m benchmarks.prefix_sharing --plot docs/performance_prefix.png   # ~10 min on 1 thread
    python -m benchmarks.prefix_sharing --smoke                             # seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # ``python benchmarks/prefix_sharing.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    MODEL_10M,
    MODEL_SMOKE,
    HandLoop,
    SdkSide,
    alternate,
    check_verdict,
    make_model_dir,
    num_parameters,
    ratio_summary,
    rows_to_datums,
    run_standalone,
    summary,
)
from benchmarks.server import API_KEY, ServerProcess, available, process_cpu_s, rows_to_tinker

NAME = "prefix_sharing"
TARGET_HAND = 0.40
COMPLETIONS = (8, 48)


def grid(smoke: bool) -> dict:
    if smoke:
        return {"headline": (2, 24, 4), "below_minimum": (2, 5, 4), "prompt_len": [4, 24], "group_size": [2, 4], "sweep_prompt_len": 24,
                "sweep_group_size": 4, "sweep_prompts": 2}
    return {"headline": (4, 320, 8), "below_minimum": (4, 5, 8), "prompt_len": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
            "group_size": [2, 4, 8, 16],
            "sweep_prompt_len": 256, "sweep_group_size": 8, "sweep_prompts": 2}


def group_rows(prompts: int, prompt_len: int, group: int, vocab: int, seed: int = 0) -> list[dict]:
    """SFT-shaped rows of a GRPO batch: weights 0 on the prompt, 1 on the completion."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(prompts):
        prompt = rng.integers(0, vocab, prompt_len)
        for _ in range(group):
            seq = np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(COMPLETIONS[0], COMPLETIONS[1] + 1)))])
            weights = np.zeros(len(seq) - 1, np.float32)
            weights[prompt_len - 1:] = 1.0
            rows.append({"tokens": seq[:-1], "targets": seq[1:], "weights": weights})
    return rows


def _case(sides: dict, rows: list[dict], reps: int, warmup: int) -> dict:
    datums = rows_to_datums(rows)
    calls = {name: (lambda side=side: side.step(rows)) if name == "hand" else (lambda side=side: side.step(datums))
             for name, side in sides.items()}
    wall, cpu = alternate(calls, reps=reps, warmup=warmup)
    tokens = sum(len(r["tokens"]) for r in rows)
    plan = sides["shared"].backend.engine.runner.plan(datums)
    unique = sum(mb.input_ids.shape[1] for mb in plan if mb.prefix is not None)
    unique += sum(int(mb.offsets[-1]) for mb in plan if mb.prefix is None)
    out = {"tokens": tokens, "unique_tokens": unique, "padded_tokens": max(len(r["tokens"]) for r in rows) * len(rows),
           **{f"{n}_s": summary(wall[n]) for n in sides}, **{f"{n}_cpu_s": summary(cpu[n]) for n in sides}}
    if "unshared" in sides:
        out["speedup"] = ratio_summary(cpu["unshared"], cpu["shared"])  # CPU seconds: load-insensitive
        out["speedup_wall"] = ratio_summary(wall["unshared"], wall["shared"])
    if "hand" in sides:
        out["ratio_to_hand"] = ratio_summary(cpu["shared"], cpu["hand"])
        out["ratio_to_hand_wall"] = ratio_summary(wall["shared"], wall["hand"])
        out["unshared_to_hand"] = ratio_summary(cpu["unshared"], cpu["hand"])
    return out


def _through_server(ctx, model_dir: Path, rows: list[dict], reps: int, warmup: int) -> dict:
    """``forward_backward`` + ``optim_step`` of ``rows`` from the tinker client, on a server with
    prefix sharing (its default) and one without, alternated; each step's wall time and the
    serving process's CPU seconds (load-insensitive, as the in-process sides' CPU time)."""
    why = available()
    if why is not None:
        return {"status": why}
    import tempfile

    import tinker
    from tinker import types as tt

    data, adam = rows_to_tinker(rows), tt.AdamParams(learning_rate=1e-4)
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-prefix-serve-") as tmp:
        servers = {"shared": ServerProcess(f"{tmp}/on", ctx.threads or 1, model=str(model_dir))}
        try:
            servers["unshared"] = ServerProcess(f"{tmp}/off", ctx.threads or 1, model=str(model_dir),
                                                extra=("--engine-config", '{"prefix_sharing": false}'))
            services = {n: tinker.ServiceClient(base_url=srv.url, api_key=API_KEY) for n, srv in servers.items()}
            clients = {n: svc.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0).result(timeout=600)
                       for n, svc in services.items()}
            cpu: dict[str, list[float]] = {n: [] for n in servers}

            def step(name: str) -> None:
                c0 = process_cpu_s(servers[name].proc.pid)
                fb, opt = clients[name].forward_backward(data, "cross_entropy"), clients[name].optim_step(adam)
                fb.result(timeout=1800)
                opt.result(timeout=1800)
                cpu[name].append(process_cpu_s(servers[name].proc.pid) - c0)

            wall, _ = alternate({n: (lambda n=n: step(n)) for n in servers}, reps=reps, warmup=warmup)
            cpu = {n: v[warmup:] for n, v in cpu.items()}  # the timed repetitions only
            for svc in services.values():
                svc.close("success").result(timeout=60)
        finally:
            for srv in servers.values():
                srv.stop()
    return {"status": "ok", "lora_rank": 8, **{f"{n}_s": summary(wall[n]) for n in servers},
            **{f"{n}_server_cpu_s": summary(cpu[n]) for n in servers},
            "speedup": ratio_summary(cpu["unshared"], cpu["shared"]),
            "speedup_wall": ratio_summary(wall["unshared"], wall["shared"])}


def run(ctx) -> dict:
    from skyrl_sdk.models import prefix

    g = grid(ctx.smoke)
    spec = MODEL_SMOKE if ctx.smoke else MODEL_10M
    model_dir = make_model_dir(ctx.workdir / "model_prefix", spec)
    reps, warmup = (1, 0) if ctx.smoke else (getattr(ctx, "prefix_reps", None) or 3, 1)
    out = {"model": {**spec, "parameters": num_parameters(spec)}, "completions": list(COMPLETIONS), "reps": reps,
           "threads": ctx.threads}
    shared = SdkSide(model_dir)
    unshared = SdkSide(model_dir, {"prefix_sharing": False})
    any_head = SdkSide(model_dir, {"prefix_sharing_min_tokens": 1})
    try:
        prompts, plen, group = g["headline"]
        ctx.log(f"{NAME}: headline {prompts} x {plen} x {group} (shared, unshared, hand) ...")
        hand = HandLoop(model_dir)
        rows = group_rows(prompts, plen, group, spec["vocab"])
        case = _case({"shared": shared, "unshared": unshared, "hand": hand}, rows, reps, warmup)
        del hand
        case.update(prompts=prompts, prompt_len=plen, group_size=group, target=TARGET_HAND,
                    verdict=check_verdict(case["ratio_to_hand"]["median"], TARGET_HAND))
        out["headline"] = case
        ctx.log(f"{NAME}: shared / hand {case['ratio_to_hand']['median']:.3f}, unshared / hand "
                f"{case['unshared_to_hand']['median']:.3f}, speedup {case['speedup']['median']:.2f}x")
        prompts, plen, group = g["below_minimum"]
        below = _case({"shared": shared, "unshared": unshared}, group_rows(prompts, plen, group, spec["vocab"]),
                      reps * 3, warmup)  # short steps: more repetitions
        out["below_minimum"] = {**below, "prompts": prompts, "prompt_len": plen, "group_size": group}
        ctx.log(f"{NAME}: prompts of {plen} tokens (nothing shared): speedup {below['speedup']['median']:.3f}x")
        out["through_server"] = srv = _through_server(ctx, model_dir, rows, reps, warmup)
        if srv["status"] == "ok":
            ctx.log(f"{NAME}: through skyrl-sdk serve (LoRA): speedup {srv['speedup']['median']:.2f}x "
                    f"(server CPU), {srv['speedup_wall']['median']:.2f}x (wall)")
        sweeps = {"prompt_len": [(g["sweep_prompts"], p, g["sweep_group_size"]) for p in g["prompt_len"]],
                  "group_size": [(g["sweep_prompts"], g["sweep_prompt_len"], k) for k in g["group_size"]]}
        saved_fraction = prefix.MIN_SAVED_FRACTION
        prefix.MIN_SAVED_FRACTION = 0.0  # share whatever is common: the sweep looks for the break-even
        try:
            for sweep, points in sweeps.items():
                out[sweep] = []
                for prompts, plen, group in points:
                    rows = group_rows(prompts, plen, group, spec["vocab"])
                    c = _case({"shared": any_head, "unshared": unshared}, rows, reps, warmup)
                    c.update(prompts=prompts, prompt_len=plen, group_size=group)
                    out[sweep].append(c)
                    ctx.log(f"{NAME}: P={plen} G={group}: speedup {c['speedup']['median']:.2f}x "
                            f"({c['tokens']} -> {c['unique_tokens']} tokens)")
        finally:
            prefix.MIN_SAVED_FRACTION = saved_fraction
    finally:
        for side in (shared, unshared, any_head):
            side.close()
    above = [c["prompt_len"] for c in out["prompt_len"] if c["speedup"]["median"] > 1.0]
    out["break_even_prompt_len"] = min(above) if above else None
    return out


def targets(result: dict) -> list[dict]:
    h = result["headline"]
    r = h["ratio_to_hand"]
    rows = [{"benchmark": NAME, "metric": "RL training phase, shared prompts (shared / padded hand loop, CPU)",
             "median": r["median"], "min": r["min"], "max": r["max"], "target": h["target"], "verdict": h["verdict"]}]
    s = h["speedup"]
    rows.append({"benchmark": NAME, "metric": "RL training phase speedup (sharing off / on, CPU), reported",
                 "median": s["median"], "min": s["min"], "max": s["max"], "target": None, "verdict": "reported"})
    srv = result.get("through_server", {})
    if srv.get("status") == "ok":
        s = srv["speedup"]
        rows.append({"benchmark": NAME, "metric": "the same through skyrl-sdk serve + tinker client, LoRA "
                     "(sharing off / on, server CPU), reported", "median": s["median"], "min": s["min"],
                     "max": s["max"], "target": None, "verdict": "reported"})
    return rows


def table(result: dict) -> list[str]:
    h = result["headline"]
    lines = [f"headline {h['prompts']} x {h['prompt_len']} x {h['group_size']}: {h['tokens']} tokens, "
             f"{h['unique_tokens']} unique; shared {h['shared_s']['median']:.3f} s, unshared "
             f"{h['unshared_s']['median']:.3f} s, hand {h['hand_s']['median']:.3f} s; shared / hand (CPU) "
             f"{h['ratio_to_hand']['median']:.3f} (<= {h['target']}: {h['verdict']})"]
    b = result["below_minimum"]
    lines.append(f"prompts of {b['prompt_len']} tokens (below the minimum, nothing shared): sharing off / on (CPU) "
                 f"{b['speedup']['median']:.3f} ({b['speedup']['min']:.3f}-{b['speedup']['max']:.3f}; 1: no cost)")
    srv = result.get("through_server", {})
    lines.append(f"through skyrl-sdk serve (tinker client, LoRA): shared {srv['shared_s']['median']:.3f} s, unshared "
                 f"{srv['unshared_s']['median']:.3f} s; speedup {srv['speedup']['median']:.2f}x (server CPU)"
                 if srv.get("status") == "ok" else f"through skyrl-sdk serve: {srv.get('status')}")
    lines += ["",
             "| prompt tokens | group | tokens -> unique | speedup (CPU) median (min-max) |", "|---|---|---|---|"]
    for c in result["prompt_len"] + result["group_size"]:
        s = c["speedup"]
        lines.append(f"| {c['prompt_len']} | {c['group_size']} | {c['tokens']} -> {c['unique_tokens']} | "
                     f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")
    lines.append(f"break-even prompt length (first with speedup > 1): {result['break_even_prompt_len']}")
    return lines


def plot(result: dict, path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, sweep, key, label in ((axes[0], "prompt_len", "prompt_len", "prompt tokens (group of 8)"),
                                  (axes[1], "group_size", "group_size", "group size (prompt of 256 tokens)")):
        cases = result[sweep]
        x = [c[key] for c in cases]
        med = [c["speedup"]["median"] for c in cases]
        lo = [c["speedup"]["median"] - c["speedup"]["min"] for c in cases]
        hi = [c["speedup"]["max"] - c["speedup"]["median"] for c in cases]
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label="measured (CPU time)")
        ideal = [c["tokens"] / c["unique_tokens"] for c in cases]
        ax.plot(x, ideal, linestyle="--", color="grey", label="tokens / unique tokens")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("speedup, sharing off / on")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    m = result["model"]
    fig.suptitle(f"Prefix sharing: forward_backward + optim_step, {m['parameters'] / 1e6:.1f}M-param Llama, "
                 f"completions of {result['completions'][0]}-{result['completions'][1]} tokens, 1 thread", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=80)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_sharing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy model and batches, 1 repetition")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per point (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    result = run_standalone(run, smoke=args.smoke, threads=args.threads, quiet=args.quiet, name="prefix",
                            prefix_reps=args.reps)
    if args.plot:
        result["plot"] = plot(result, args.plot)
    print(json.dumps(result, indent=2))
    if not args.quiet:
        print("\n".join(table(result)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
