"""Benchmark: peak memory of one ``forward_backward`` with prefix sharing on and off, over prompt
lengths and group sizes (the shape of an RL batch: one prompt, G short samples).

Each cell is a prompt of P random tokens and G samples of 4 more tokens on the built-in
``tiny`` model (``cross_entropy`` on every position, the library's defaults: 8192-token
micro-batches). Each side of each cell runs in a fresh process (``benchmarks.prefix_memory_worker``):
load, one warm-up call, reset the kernel's peak-RSS mark (``/proc/self/clear_refs``), one
``forward_backward``, read the peak (``VmHWM``) minus the RSS before it
(docs/PLATFORM_NOTES: how memory is measured here). Reported per cell: both peaks, their ratio,
both times (wall and process CPU seconds: other jobs on a shared machine disturb the CPU
seconds less); the target: sharing never raises the peak (shared / unshared <= 1 in every cell).

    python -m benchmarks.prefix_memory            # the sweep, ~15 min on one thread (the unshared side)
    python -m benchmarks.prefix_memory --smoke    # seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/prefix_memory.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import check_verdict, run_standalone, run_worker, summary

NAME = "prefix_memory"
#: shared peak / unshared peak, in every cell
TARGET = 1.0
SUFFIX = 4


def grid(smoke: bool) -> tuple[list[int], list[int]]:
    """(prompt lengths, group sizes)."""
    return ([40], [8]) if smoke else ([100, 380, 1000, 2000], [4, 16, 64, 256])


def _side(ctx, side: str, prompt_len: int, group: int) -> dict:
    return run_worker("benchmarks.prefix_memory_worker", [
        "--prompt-len", str(prompt_len), "--group", str(group), "--suffix", str(SUFFIX), "--side", side,
        "--threads", str(ctx.threads or 1)], f"prefix memory ({side}, P={prompt_len}, G={group})")


def run(ctx) -> dict:
    prompt_lens, groups = grid(ctx.smoke)
    reps = 1 if ctx.smoke else (getattr(ctx, "prefix_memory_reps", None) or 1)
    cells = []
    for plen in prompt_lens:
        for group in groups:
            samples: dict[str, list[dict]] = {"shared": [], "unshared": []}
            for rep in range(reps):  # alternated: neither side always runs first
                for side in ("shared", "unshared") if rep % 2 == 0 else ("unshared", "shared"):
                    samples[side].append(_side(ctx, side, plen, group))
            mib = {s: [r["peak_delta_bytes"] / 2**20 for r in samples[s]] for s in samples}
            cell = {"prompt_len": plen, "group_size": group, "suffix": SUFFIX, "tokens": samples["shared"][0]["tokens"],
                    "shared_rows": samples["shared"][0]["shared_rows"],
                    "micro_batches": {s: samples[s][0]["micro_batches"] for s in samples},
                    "shared_peak_mib": summary(mib["shared"]), "unshared_peak_mib": summary(mib["unshared"]),
                    "shared_s": summary([r["seconds"] for r in samples["shared"]]),
                    "unshared_s": summary([r["seconds"] for r in samples["unshared"]]),
                    "shared_cpu_s": summary([r["cpu_seconds"] for r in samples["shared"]]),
                    "unshared_cpu_s": summary([r["cpu_seconds"] for r in samples["unshared"]]),
                    "peak_ratio": summary([a / b for a, b in zip(mib["shared"], mib["unshared"], strict=True)])}
            cells.append(cell)
            ctx.log(f"{NAME}: P={plen} G={group}: peak shared {cell['shared_peak_mib']['median']:.0f} MiB, unshared "
                    f"{cell['unshared_peak_mib']['median']:.0f} MiB; CPU {cell['shared_cpu_s']['median']:.2f} s vs "
                    f"{cell['unshared_cpu_s']['median']:.2f} s")
    worst = max(c["peak_ratio"]["max"] for c in cells)
    return {"model": "tiny", "suffix": SUFFIX, "reps": reps, "threads": ctx.threads,
            "method": "fresh process per side and cell; VmHWM after clear_refs minus the RSS before the call",
            "cells": cells, "worst_peak_ratio": worst, "target": TARGET, "verdict": check_verdict(worst, TARGET)}


def targets(result: dict) -> list[dict]:
    ratios = [c["peak_ratio"]["median"] for c in result["cells"]]
    return [{"benchmark": NAME, "metric": "peak memory, sharing on / off (worst cell of the sweep)",
             "median": max(ratios), "min": min(ratios), "max": result["worst_peak_ratio"], "target": result["target"],
             "verdict": result["verdict"]}]


def table(result: dict) -> list[str]:
    lines = ["| prompt tokens | group | tokens | peak shared MiB | peak unshared MiB | shared / unshared | "
             "CPU s shared | CPU s unshared |", "|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        lines.append(f"| {c['prompt_len']} | {c['group_size']} | {c['tokens']} | {c['shared_peak_mib']['median']:.0f} | "
                     f"{c['unshared_peak_mib']['median']:.0f} | {c['peak_ratio']['median']:.2f} | "
                     f"{c['shared_cpu_s']['median']:.2f} | {c['unshared_cpu_s']['median']:.2f} |")
    lines.append(f"worst shared / unshared: {result['worst_peak_ratio']:.3f} (<= {result['target']}: {result['verdict']})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a small grid: checks the path, not a measurement")
    p.add_argument("--reps", type=int, default=None, help="processes per side and cell (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    result = run_standalone(run, smoke=args.smoke, threads=args.threads, quiet=args.quiet, name="prefix-memory",
                            prefix_memory_reps=args.reps)
    print(json.dumps(result, indent=2))
    if not args.quiet:
        print("\n".join(table(result)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
