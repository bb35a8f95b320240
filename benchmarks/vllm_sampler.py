"""Benchmark: the ``vllm`` sampler (plugins/skyrl-sdk-vllm) against vLLM alone and the built-in
sampler, and the time its weights take to follow a step.

Throughput: three sides in one process, alternating (ABC CBA ...), the same weights and
prompts, every row drawn to exactly ``new_tokens`` (``stop=[]``), temperature 1:

- ``vllm_alone``: ``vllm.LLM.generate`` on an engine started from the exported weights
  (``save_weights_for_sampler``) the way a user starts one, in this process like the plugin's,
  asking for the sampled tokens' logprobs too;
- ``plugin``: ``Backend(sampler="vllm").sample`` (a group's prompt prefilled once, as shipped);
- ``builtin``: ``Backend(sampler="transformers").sample``.

Reported: tokens/s of each side, the plugin's time over vLLM alone (target <= 1.10) and the
built-in's over the plugin's. Weight sync, for models of growing size: a one-token sample
right after an ``optim_step`` minus the same sample with no change (the sync it triggers:
full fine-tuning reloads every weight in place, LoRA pushes one rank-16 adapter), and the
bytes pushed. Without vLLM installed the benchmark says "not available".
"""

from __future__ import annotations

import importlib.util

from .common import alternate, check_verdict, make_model_dir, num_parameters, ratio_summary, summary
from .sampling_sides import make_prompts

NAME = "vllm_sampler"
TARGET_OVERHEAD = 1.10
LORA_RANK = 16


def sizes(smoke: bool, device: str) -> dict:
    if smoke:
        return {"prompts": 2, "samples": 2, "new_tokens": 8, "prompt_len": 16,
                "model": dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, tie=False),
                "sync_hidden": [64], "sync_reps": 1}
    if device.startswith("cuda"):
        return {"prompts": 32, "samples": 8, "new_tokens": 256, "prompt_len": 128,
                "model": dict(vocab=32000, hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, tie=False),
                "sync_hidden": [512, 1024, 2048], "sync_reps": 5}
    return {"prompts": 8, "samples": 8, "new_tokens": 64, "prompt_len": 32,
            "model": dict(vocab=8192, hidden=256, intermediate=768, layers=6, heads=8, kv_heads=4, tie=False),
            "sync_hidden": [128, 256, 512], "sync_reps": 3}


def _sync_spec(hidden: int) -> dict:
    """A Llama of width ``hidden`` (heads of 32-64 dimensions: vLLM's CPU attention takes no less)."""
    heads = max(2, hidden // 64)
    return dict(vocab=8192, hidden=hidden, intermediate=3 * hidden, layers=6, heads=heads, kv_heads=max(1, heads // 2),
                tie=False)


def _sampler_config(device: str) -> dict:
    return {"kv_cache_gib": 0.25} if device == "cpu" else {"gpu_memory_utilization": 0.25}


def available() -> str | None:
    """None when the benchmark can run, else why not."""
    if importlib.util.find_spec("vllm") is None:
        return "not available (vLLM is not installed: pip install -e 'plugins/skyrl-sdk-vllm[cpu]' or '[gpu]')"
    from skyrl_sdk import get_registry

    if "vllm" not in get_registry().samplers:
        return "not available (sampler 'vllm' is not registered: pip install -e plugins/skyrl-sdk-vllm)"
    return None


class VllmAlone:
    """``LLM.generate`` on the exported weights, in this process (as the plugin's engine runs)."""

    def __init__(self, model_dir, device: str, max_model_len: int) -> None:
        from skyrl_sdk_vllm.loading import on_cpu, start_engine

        args = dict(model=str(model_dir), dtype="float32" if device == "cpu" else "bfloat16", seed=0,
                    enable_prefix_caching=True, max_model_len=max_model_len, generation_config="vllm")
        config = _sampler_config(device)
        if "kv_cache_gib" in config:
            args["kv_cache_memory_bytes"] = int(config["kv_cache_gib"] * 2**30)
        else:
            args["gpu_memory_utilization"] = config["gpu_memory_utilization"]
        self.llm = start_engine(**args, enforce_eager=on_cpu())

    def sample(self, prompts, num_samples: int, new_tokens: int, seed: int = 1) -> int:
        from vllm import SamplingParams

        params = SamplingParams(n=num_samples, max_tokens=new_tokens, temperature=1.0, ignore_eos=True, logprobs=0,
                                seed=seed, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


class SdkSide:
    """``Backend.sample`` with ``stop=[]`` through the sampler ``sampler``."""

    def __init__(self, model_dir, device: str, sampler: str, **backend) -> None:
        import skyrl_sdk

        dtype = "float32" if device == "cpu" else "bfloat16"
        self.backend = skyrl_sdk.Backend(model=str(model_dir), engine_config={"device": device, "dtype": dtype},
                                         sampler=sampler,
                                         sampler_config=_sampler_config(device) if sampler == "vllm" else None,
                                         **backend)

    def sample(self, prompts, num_samples: int, new_tokens: int, seed: int = 1) -> int:
        from skyrl_sdk import types

        params = types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=seed)
        out = self.backend.sample(prompts, params, num_samples=num_samples)
        return sum(len(s.tokens) for o in out for s in o.sequences)


def _throughput(ctx, size: dict) -> dict:
    device = getattr(ctx, "device", "cpu")
    model_dir = make_model_dir(ctx.workdir / "model_vllm", size["model"])
    prompts = make_prompts(size["prompts"], size["prompt_len"], size["model"]["vocab"])
    plugin, builtin = SdkSide(model_dir, device, "vllm"), SdkSide(model_dir, device, "transformers")
    exported = ctx.workdir / "model_vllm_exported"
    plugin.backend.save_weights_for_sampler(exported, overwrite=True)  # what vLLM alone loads
    alone = VllmAlone(exported, device, max_model_len=size["prompt_len"] + size["new_tokens"] + 16)
    n, t = size["samples"], size["new_tokens"]
    sides = {"vllm_alone": alone, "plugin": plugin, "builtin": builtin}
    try:
        for side in sides.values():  # warm-up (and the plugin's engine start) with a short batch
            side.sample(prompts, n, min(t, 4))
        wall, cpu = alternate({k: (lambda s=s: s.sample(prompts, n, t)) for k, s in sides.items()},
                              reps=getattr(ctx, "sampling_reps", 1), warmup=0)
        describe = plugin.backend.sampler.describe()
    finally:
        alone.close()
        plugin.backend.close()
        builtin.backend.close()
    tokens = size["prompts"] * n * t
    overhead = ratio_summary(wall["plugin"], wall["vllm_alone"])
    ctx.log(f"{NAME}: plugin / vLLM alone {overhead['median']:.3f} ({overhead['min']:.3f}-{overhead['max']:.3f})")
    return {
        "model": {**size["model"], "parameters": num_parameters(size["model"])}, "sampler": describe,
        **{k: size[k] for k in ("prompts", "samples", "new_tokens", "prompt_len")},
        "tokens_per_s": {k: summary([tokens / s for s in v]) for k, v in wall.items()},
        "overhead": overhead, "cpu_overhead": ratio_summary(cpu["plugin"], cpu["vllm_alone"]),
        "builtin_over_plugin": ratio_summary(wall["builtin"], wall["plugin"]),
        "target_overhead": TARGET_OVERHEAD, "verdict_overhead": check_verdict(overhead["median"], TARGET_OVERHEAD),
    }


def _sync(ctx, hidden: int, lora: bool, reps: int) -> dict:
    """Seconds a weight change adds to the next sample, and what the sampler pushed."""
    import time

    from skyrl_sdk import types
    from skyrl_sdk.testing import make_sft_data

    device = getattr(ctx, "device", "cpu")
    spec = _sync_spec(hidden)
    model_dir = make_model_dir(ctx.workdir / f"model_sync_{hidden}", spec)
    side = SdkSide(model_dir, device, "vllm", lora={"rank": LORA_RANK} if lora else None)
    b, prompt, one = side.backend, [[1, 2, 3, 4]], {"max_tokens": 1, "stop": []}
    data = make_sft_data([16, 16], vocab=spec["vocab"])
    changed, same, pushed = [], [], []
    try:
        b.sample(prompt, one)  # starts the engine
        for _ in range(reps):
            b.forward_backward(data, "cross_entropy")
            b.optim_step(types.AdamParams(learning_rate=1e-4))
            t0 = time.perf_counter()
            b.sample(prompt, one)
            changed.append(time.perf_counter() - t0)
            pushed.append(b.sampler.last_sync)
            t0 = time.perf_counter()
            b.sample(prompt, one)
            same.append(time.perf_counter() - t0)
    finally:
        b.close()
    return {"parameters": num_parameters(spec), "hidden": hidden, "kind": "lora" if lora else "full",
            "sync_s": summary([c - s for c, s in zip(changed, same, strict=True)]),
            "engine_load_s": summary([p.get("load_seconds", p["seconds"]) for p in pushed]),
            "bytes": pushed[-1]["bytes"]}


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why}
    device = getattr(ctx, "device", "cpu")
    size = sizes(ctx.smoke, device)
    result = {"status": "ok", "device": device, "throughput": _throughput(ctx, size)}
    result["sync"] = [_sync(ctx, h, lora, size["sync_reps"]) for h in size["sync_hidden"] for lora in (False, True)]
    for row in result["sync"]:
        ctx.log(f"{NAME}: {row['kind']} sync of a {row['parameters'] / 1e6:.1f}M model: "
                f"{row['sync_s']['median'] * 1e3:.1f} ms ({row['bytes'] / 2**20:.1f} MiB)")
    return result


def targets(result: dict) -> list[dict]:
    o = result["throughput"]["overhead"]
    return [{"benchmark": NAME, "metric": "time of sampler='vllm' / vLLM alone (LLM.generate), same batch",
             "median": o["median"], "min": o["min"], "max": o["max"], "target": TARGET_OVERHEAD,
             "verdict": result["throughput"]["verdict_overhead"]}]


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [str(result.get("status"))]
    t = result["throughput"]
    lines = [f"{t['prompts']} prompts x {t['samples']} samples x {t['new_tokens']} tokens, "
             f"{t['model']['parameters'] / 1e6:.1f}M parameters, {result['device']}; {t['sampler']}", "",
             "| side | tokens/s (median, min-max) |", "|---|---|"]
    for side, s in t["tokens_per_s"].items():
        lines.append(f"| {side} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) |")
    o, b = t["overhead"], t["builtin_over_plugin"]
    lines += ["", f"plugin / vLLM alone: {o['median']:.3f} ({o['min']:.3f}-{o['max']:.3f}), target <= "
                  f"{TARGET_OVERHEAD}: {t['verdict_overhead']}; built-in / plugin: {b['median']:.2f}", "",
              "| model | kind | bytes pushed | sync (ms, median) | engine load (ms) |", "|---|---|---|---|---|"]
    for r in result["sync"]:
        lines.append(f"| {r['parameters'] / 1e6:.1f}M | {r['kind']} | {r['bytes'] / 2**20:.2f} MiB | "
                     f"{r['sync_s']['median'] * 1e3:.1f} | {r['engine_load_s']['median'] * 1e3:.1f} |")
    return lines
