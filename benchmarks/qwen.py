"""Benchmark 9: a realistic size, a Qwen2.5-0.5B-shaped model (494M parameters, random weights).

forward_backward + optim_step + save_weights_for_sampler + sample, with LoRA and with full
fine-tuning, bf16-mixed (fp32 masters), each in a fresh process
(``python -m benchmarks.qwen_worker``). Memory is the process's peak RSS on CPU and
``torch.cuda.max_memory_allocated`` with ``--device cuda``. The model directory is written
locally (no hub) by another fresh process, so its creation does not count.

Sizes: 2 sequences x 128 tokens per step (CPU-friendly; the same on CUDA), LoRA 2 steps
(the second is the steady one), full fine-tuning 1 step: its fp32 masters, gradients and
AdamW moments alone take 16 bytes per parameter (7.9 GB), and a second step would hold
the gradients and the moments at once with the autocast copies (~9.5 GB): the run is
skipped when the machine has not enough memory available.
"""

from __future__ import annotations

from .common import run_worker

NAME = "qwen_0p5b"
MODES = {"lora": {"steps": 2}, "full": {"steps": 1}}
#: Bytes per parameter a full fine-tuning step needs (fp32 weights, grads, 2 moments, bf16 copies).
FULL_BYTES_PER_PARAM = 18
#: The model's size (Qwen2.5-0.5B): what the memory check of full fine-tuning assumes.
QWEN_0P5B_PARAMS = 494_032_768


def _python(args: list[str], timeout: int = 3600) -> dict:
    return run_worker("benchmarks.qwen_worker", args, "qwen", timeout=timeout)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _in_process(args: list[str]) -> dict:
    """Smoke mode: the worker's code in this process (checks the path, not a measurement)."""
    from . import qwen_worker

    parsed = qwen_worker.parser().parse_args(args)
    if parsed.make_model:
        from pathlib import Path

        return qwen_worker.make_model(Path(parsed.make_model), qwen_worker.QWEN_SMOKE)
    return qwen_worker.run(parsed)


def run(ctx) -> dict:
    device = getattr(ctx, "device", "cpu")
    model_dir = ctx.workdir / ("model_qwen_smoke" if ctx.smoke else "model_qwen0p5b")
    worker = _in_process if ctx.smoke else _python
    made = worker(["--make-model", str(model_dir), "--threads", str(ctx.threads)] + (["--smoke"] if ctx.smoke else []))
    batch, seq = (2, 32) if ctx.smoke else (2, 128)
    out = {"device": device, "batch": batch, "seq_len": seq, "model_dir": made, "modes": {}}
    for mode, opts in MODES.items():
        if mode == "full" and device == "cpu" and not ctx.smoke:
            need = FULL_BYTES_PER_PARAM * QWEN_0P5B_PARAMS + 2**30
            avail = _available_bytes()
            if avail is not None and avail < need:
                out["modes"][mode] = {
                    "status": f"skipped: needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} available"}
                continue
        ctx.log(f"{NAME}/{mode} ...")
        res = worker(["--model", str(model_dir), "--mode", mode, "--device", device, "--batch", str(batch),
                       "--seq", str(seq), "--steps", str(opts["steps"]), "--threads", str(ctx.threads),
                       "--scratch", str(ctx.workdir)])
        last = res["steps"][-1]
        res["step_s"] = last["forward_backward_s"] + last["optim_step_s"]
        res["tokens_per_s"] = batch * seq / res["step_s"]
        res["peak_gib"] = (res.get("cuda_max_memory_allocated_bytes") or res["peak_rss_bytes"]) / 2**30
        res["memory_measure"] = "torch.cuda.max_memory_allocated" if "cuda_max_memory_allocated_bytes" in res \
            else "peak RSS (VmHWM) of the process"
        ctx.log(f"{NAME}/{mode}: step {res['step_s']:.1f} s, peak {res['peak_gib']:.2f} GiB")
        out["modes"][mode] = res
    return out


def targets(result: dict) -> list[dict]:
    rows = []
    for mode, r in result["modes"].items():
        if "step_s" not in r:
            rows.append({"benchmark": NAME, "metric": f"{mode}: step", "target": None, "verdict": r.get("status")})
            continue
        for metric, value in ((f"{mode}: step time s (fwd+bwd+AdamW), reported", r["step_s"]),
                              (f"{mode}: peak GiB ({r['memory_measure']}), reported", r["peak_gib"])):
            rows.append({"benchmark": NAME, "metric": metric, "median": value, "min": value, "max": value,
                         "target": None, "verdict": "reported"})
    return rows


def table(result: dict) -> list[str]:
    lines = [
        f"device {result['device']}, {result['batch']} x {result['seq_len']} tokens per step", "",
        "| mode | parameters (trainable) | load s | forward_backward s | optim_step s | tokens/s | "
        "save_weights_for_sampler s (GB) | sample s (tokens) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in result["modes"].items():
        if "step_s" not in r:
            lines.append(f"| {mode} | {r.get('status')} | | | | | | | |")
            continue
        last = r["steps"][-1]
        lines.append(
            f"| {mode} | {r['parameters'] / 1e6:.0f}M ({r['trainable_parameters'] / 1e6:.1f}M) | {r['load_s']:.1f} | "
            f"{last['forward_backward_s']:.2f} | {last['optim_step_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['export_s']:.1f} ({r['export_bytes'] / 1e9:.2f}) | {r['sample_s']:.2f} ({r['sampled_tokens']}) | "
            f"{r['peak_gib']:.2f} |"
        )
    return lines
