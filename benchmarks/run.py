"""Run the benchmark suite.

    python -m benchmarks.run                 # every benchmark, human-readable tables
    python -m benchmarks.run --json          # one JSON document on stdout
    python -m benchmarks.run --smoke --json  # seconds-long check that everything runs (CI)
    python -m benchmarks.run --only step_time,peak_memory
    python -m benchmarks.run --plot docs/performance_scaling.png
    python -m benchmarks.run --only qwen_0p5b --device cuda   # the ~0.5B model on a GPU

Progress goes to stderr; the tables or the JSON document to stdout. The exit status is 1
when a benchmark raised (a benchmark whose component is missing reports "not available").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/run.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (
    call_grads,
    checkpointing,
    distributed,
    fsdp,
    fsdp_loading,
    grpo,
    grpo_prefix,
    input_path,
    memory,
    optim_step,
    precision,
    prefix_memory,
    prefix_sharing,
    qwen,
    sampling,
    scaling,
    serve_load,
    server,
    step,
    tenancy,
    vllm_sampler,
)
from benchmarks.common import MODEL_10M, MODEL_32K, MODEL_SMOKE, set_threads

BENCHMARKS = {
    step.NAME: step,
    memory.NAME: memory,
    input_path.NAME: input_path,
    server.NAME: server,
    fsdp.NAME: fsdp,
    fsdp_loading.NAME: fsdp_loading,
    scaling.NAME: scaling,
    sampling.NAME: sampling,
    tenancy.NAME: tenancy,
    serve_load.NAME: serve_load,
    precision.NAME: precision,
    checkpointing.NAME: checkpointing,
    qwen.NAME: qwen,
    grpo.NAME: grpo,
    optim_step.NAME: optim_step,
    call_grads.NAME: call_grads,
    prefix_sharing.NAME: prefix_sharing,
    prefix_memory.NAME: prefix_memory,
    grpo_prefix.NAME: grpo_prefix,
    vllm_sampler.NAME: vllm_sampler,
    distributed.NAME: distributed,
}


class Context:
    """What every benchmark reads: sizes, repetitions, threads, a scratch directory."""

    def __init__(self, args, workdir: Path) -> None:
        self.smoke = args.smoke
        self.workdir = workdir
        self.threads = args.threads
        self.engine_config = json.loads(args.engine_config) if args.engine_config else {}
        self.model_spec = MODEL_SMOKE if self.smoke else MODEL_10M
        self.memory_spec = MODEL_SMOKE if self.smoke else MODEL_32K
        reps = args.reps
        self.warmup = 0 if self.smoke else 1
        self.reps = reps or (1 if self.smoke else 7)
        self.memory_reps = 1 if self.smoke else (args.reps or 3)
        self.input_step_reps = 1  # a 64 x 2048 step takes minutes on one CPU thread
        self.server_reps = reps or (1 if self.smoke else 15)
        self.fsdp_reps = reps or (1 if self.smoke else 5)
        self.scaling_reps = 1 if self.smoke else (args.reps or 3)
        self.sampling_reps = 1 if self.smoke else (args.reps or 2)  # a full rep is ~1 min per side
        self.quiet = args.quiet
        self.device = args.device

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    def settings(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("workdir", "quiet")}


def environment(threads: int, device: str = "cpu") -> dict:
    import torch
    import transformers

    import skyrl_sdk

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "skyrl_sdk": skyrl_sdk.__version__,
        "torch_threads": threads,
        "device": device,
        "cuda_device": torch.cuda.get_device_name() if device.startswith("cuda") else None,
    }


def targets(results: dict) -> list[dict]:
    """One row per target: the measured median ratio, its min-max, the target, the verdict."""
    rows = []

    def add(bench, metric, stat, target, verdict):
        rows.append({"benchmark": bench, "metric": metric, "median": stat["median"], "min": stat["min"],
                     "max": stat["max"], "target": target, "verdict": verdict})

    r = results.get(step.NAME, {})
    for case, c in r.get("cases", {}).items():
        add(step.NAME, f"{case} step-time ratio (SDK / hand loop)", c["ratio"], c["target"], c["verdict"])
    r = results.get(optim_step.NAME, {})
    for case, c in r.get("cases", {}).items():
        add(optim_step.NAME, f"{case} optim_step / bare clip + fused AdamW (CPU)", c["ratio"], c["target"], c["verdict"])
    r = results.get(memory.NAME, {})
    if "ratio" in r:
        add(memory.NAME, "peak-memory ratio (SDK / hand loop)", r["ratio"], r["target"], r["verdict"])
    r = results.get(input_path.NAME, {})
    if "fraction_of_step" in r:
        add(input_path.NAME, "input path / step time", r["fraction_of_step"], r["target"], r["verdict"])
    r = results.get(server.NAME, {})
    if r.get("status") == "ok":
        add(server.NAME, "step-time ratio (tinker client + server / in-process)", r["ratio"], r["target"], r["verdict"])
    elif r:
        rows.append({"benchmark": server.NAME, "metric": "server round trip", "target": server.TARGET,
                     "verdict": r.get("status")})
    r = results.get(fsdp.NAME, {})
    if r.get("status") == "ok":
        m = r["memory_ratio"]
        add(fsdp.NAME, "per-rank params+optimizer memory (2 ranks / local)", {"median": m, "min": m, "max": m},
            r["target_memory"], r["verdict_memory"])
        add(fsdp.NAME, "step-time ratio (fsdp 2 ranks / local), reported", r["step_time_ratio"], None, "reported")
    elif r:
        rows.append({"benchmark": fsdp.NAME, "metric": "fsdp", "target": fsdp.TARGET_MEMORY,
                     "verdict": r.get("status")})
    r = results.get(sampling.NAME, {})
    if "time_ratio" in r:
        add(sampling.NAME, "time ratio (SDK sampler / plain generate)", r["time_ratio"], r["target_time_ratio"],
            r["verdict_time"])
        g = r["sdk_peak_growth_gib"]
        add(sampling.NAME, "SDK sampler peak RSS growth (GiB)", {"median": g, "min": g, "max": g},
            r["target_peak_gib"], r["verdict_memory"])
    r = results.get(tenancy.NAME, {})
    if "memory" in r:
        for metric, part in (("memory per extra rank-8 LoRA client / base bytes", r["memory"]),
                             ("8 clients' aggregate steps/s / one client's", r["throughput"]),
                             ("fairness: fewest / most steps when the first client finishes", r["fairness"])):
            v = part["ratio"]
            add(tenancy.NAME, metric, {"median": v, "min": v, "max": v}, part["target"], part["verdict"])
    r = results.get(serve_load.NAME, {})
    if "memory" in r:
        v = r["memory"]["ratio"]
        add(serve_load.NAME, "server RSS per extra rank-8 LoRA client / base bytes (tinker client)",
            {"median": v, "min": v, "max": v}, r["memory"]["target"], r["memory"]["verdict"])
    r = results.get(fsdp_loading.NAME, {})
    if r.get("status") == "ok":
        m = r["peak_ratio"]
        add(fsdp_loading.NAME, "max per-rank peak RSS (2 ranks / local), load + 1 step",
            {"median": m, "min": m, "max": m}, r["target"], r["verdict"])
    elif r:
        rows.append({"benchmark": fsdp_loading.NAME, "metric": "fsdp loading", "target": fsdp_loading.TARGET,
                     "verdict": r.get("status")})
    for module in (precision, checkpointing, qwen, prefix_sharing, prefix_memory, grpo_prefix,
                   vllm_sampler):  # these report their own rows
        r = results.get(module.NAME, {})
        if r.get("status") == "ok":
            rows.extend(module.targets(r))
    r = results.get(vllm_sampler.NAME, {})
    if r and r.get("status") != "ok":
        rows.append({"benchmark": vllm_sampler.NAME, "metric": "sampler='vllm' / vLLM alone",
                     "target": vllm_sampler.TARGET_OVERHEAD, "verdict": r.get("status")})
    for case, c in results.get(call_grads.NAME, {}).get("cases", {}).items():
        add(call_grads.NAME, f"{case}: step time, pending gradients kept / dropped on failure, reported",
            c["time_ratio"], None, "reported")
        for size, m in c["memory"].items():
            add(call_grads.NAME, f"{case}, {m['tokens']}-token call ({size}): extra peak memory / one gradient "
                f"buffer, reported", m["extra_per_gradient_buffer"], None, "reported")
    r = results.get(grpo.NAME, {})
    for side in ("backend", "server") if r.get("status") == "ok" else ():
        v = r["sides"][side]["ratio_to_trl"]
        add(grpo.NAME, f"RL step-time ratio ({side} / TRL GRPOTrainer)", {"median": v, "min": v, "max": v},
            r["target"], r["sides"][side]["verdict"])
    return rows


def human(doc: dict) -> str:
    lines = [f"skyrl-sdk benchmarks ({'smoke' if doc['smoke'] else 'full'}; torch {doc['environment']['torch']}, "
             f"{doc['environment']['torch_threads']} threads)", ""]
    for name, result in doc["benchmarks"].items():
        lines.append(f"## {name} ({result.get('seconds', 0):.0f} s)")
        if "error" in result:
            lines.append(f"ERROR: {result['error']}")
        else:
            lines.extend(BENCHMARKS[name].table(result))
        lines.append("")
    lines.append("## targets")
    lines.append("| benchmark | metric | median (min-max) | target | verdict |")
    lines.append("|---|---|---|---|---|")
    for t in doc["targets"]:
        value = f"{t['median']:.3g} ({t['min']:.3g}-{t['max']:.3g})" if "median" in t else "-"
        target = f"{t.get('target_op', '<=')} {t['target']}" if t.get("target") is not None else "-"
        lines.append(f"| {t['benchmark']} | {t['metric']} | {value} | {target} | {t['verdict']} |")
    if doc.get("plot"):
        lines.append(f"\nplot: {doc['plot']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy sizes, 1 repetition: checks that everything runs")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per comparison (default: per benchmark)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: min(2, cores))")
    p.add_argument("--engine-config", default=None, help="JSON engine_config for the SDK side (default: defaults)")
    p.add_argument("--device", default="cpu",
                   help="device of the qwen_0p5b and vllm_sampler benchmarks: cpu or cuda (the others run on CPU)")
    p.add_argument("--plot", default=None, help="write the scaling plot (PNG) here")
    p.add_argument("--workdir", default=None, help="where model directories are created (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    names = list(BENCHMARKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown:
            p.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    args.threads = set_threads(args.threads)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import logging

    logging.getLogger("skyrl_sdk").setLevel(logging.WARNING)
    failed = False
    with tempfile.TemporaryDirectory(prefix="skyrl-bench-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        ctx = Context(args, workdir)
        doc = {"suite": "skyrl-sdk benchmarks", "smoke": args.smoke,
               "environment": environment(args.threads, args.device), "settings": ctx.settings(), "benchmarks": {}}
        t_start = time.perf_counter()
        for name in names:
            ctx.log(f"{name} ...")
            t0 = time.perf_counter()
            try:
                result = BENCHMARKS[name].run(ctx)
                result.setdefault("status", "ok")
            except Exception as exc:  # report and go on with the others
                failed = True
                traceback.print_exc(file=sys.stderr)
                result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = time.perf_counter() - t0
            doc["benchmarks"][name] = result
        if args.plot and doc["benchmarks"].get(scaling.NAME, {}).get("status") == "ok":
            doc["plot"] = scaling.plot(doc["benchmarks"][scaling.NAME], args.plot)
        doc["targets"] = targets(doc["benchmarks"])
        doc["total_seconds"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(human(doc))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
