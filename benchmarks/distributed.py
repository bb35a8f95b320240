"""Benchmark: past one device. Weight syncs by transport and model size, rollout throughput with
1 and 2 vLLM engines placed by Ray, and how long a sample waits for a training call with and
without overlap (docs/performance.md, section 21).

1. **Sync** (``fsdp`` engine, 2 spawned ranks, an engine beside the controller): after each
   ``optim_step``, the time the next one-token sample spends on the new weights (that sample
   minus the same sample with no change), side by side in one process, alternating:
   ``gloo_push`` (the ranks send the rows of their shards through vLLM's weight-transfer API,
   ``sampler_config={"transfer": "gloo"}``) and ``temp_export`` (the path before it: the ranks
   write a Hugging Face export to a temporary directory, the controller reads it and reloads
   vLLM from memory). Models of 3M, 27M and 100M parameters, float32.
2. **Rollout** (a two-node Ray cluster on 127.0.0.1): tokens/s of ``Backend.sample`` with
   ``placement="ray"`` and 1 or 2 engines, the same prompts, alternating.
3. **Overlap** (the same cluster, 2 fsdp ranks as Ray actors, 2 engines): a long
   ``forward_backward`` starts on a thread; a sample call starts while it runs; its latency with
   ``overlap`` on (the default: it does not wait for the training call) and off, and the same
   sample with no training call running.

Needs vLLM and Ray (``tox -e ray`` installs both); otherwise "not available".
"""

from __future__ import annotations

import importlib.util
import threading
import time

from .common import alternate, make_model_dir, num_parameters, ratio_summary, summary
from .sampling_sides import make_prompts

NAME = "distributed"
#: 3M / 27M / 100M parameters (vLLM's CPU attention wants heads of 32-64 dimensions)
SYNC_MODELS = {
    "3M": dict(vocab=8192, hidden=128, intermediate=384, layers=6, heads=2, kv_heads=1, tie=False),
    "27M": dict(vocab=8192, hidden=512, intermediate=1536, layers=6, heads=8, kv_heads=4, tie=False),
    "100M": dict(vocab=16384, hidden=768, intermediate=2304, layers=12, heads=12, kv_heads=6, tie=False),
}
SMOKE_MODEL = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, tie=False)
SMALL_ENGINE = {"kv_cache_gib": 0.125, "max_model_len": 512}


def available() -> str | None:
    for module, install in (("vllm", "pip install -e 'plugins/skyrl-sdk-vllm[cpu]'"),
                            ("ray", "pip install -e plugins/skyrl-sdk-ray"), ("skyrl_sdk_ray", "tox -e ray"),
                            ("skyrl_sdk_fsdp", "pip install -e plugins/skyrl-sdk-fsdp")):
        if importlib.util.find_spec(module) is None:
            return f"not available ({module} is not installed: {install})"
    return None


def _sync(ctx, label: str, spec: dict, reps: int) -> dict:
    """Seconds the next sample spends on new weights: gloo push vs the temporary export."""
    import numpy as np

    import skyrl_sdk
    import skyrl_sdk.sampling
    from skyrl_sdk import types
    from skyrl_sdk.testing import make_sft_data

    model_dir = make_model_dir(ctx.workdir / f"model_dist_{label}", spec)
    data = make_sft_data([16, 16], vocab=spec["vocab"])
    trainer = skyrl_sdk.Backend(model=str(model_dir), engine="fsdp", engine_config={"world_size": 2})
    sides = {}
    try:
        source = trainer.engine.weights_source()
        factory = skyrl_sdk.get_registry().sampler_spec("vllm").factory
        from skyrl_sdk_vllm import VllmSampler

        sides["gloo_push"] = factory(source=source, config={**SMALL_ENGINE, "transfer": "gloo"})
        sides["temp_export"] = VllmSampler(source=source, config=SMALL_ENGINE)  # the path before the push

        def step() -> None:
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-4))  # moves the engine's weights version

        request = skyrl_sdk.sampling.SampleRequest(prompts=[np.arange(1, 5, dtype=np.int64)],
                                                   sampling_params=types.SamplingParams(max_tokens=1, stop=()))
        changed: dict[str, list[float]] = {k: [] for k in sides}
        same: dict[str, list[float]] = {k: [] for k in sides}
        for side in sides.values():
            side.sample(request)
        for rep in range(reps):
            step()
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for name in order:
                t0 = time.perf_counter()
                sides[name].sample(request)
                changed[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sides[name].sample(request)
                same[name].append(time.perf_counter() - t0)
        result = {"model": label, "parameters": num_parameters(spec),
                  "bytes": sides["gloo_push"].last_sync["bytes"]}
        for name in sides:
            result[name] = summary([c - s for c, s in zip(changed[name], same[name], strict=True)])
        result["export_over_push"] = ratio_summary([c - s for c, s in zip(changed["temp_export"], same["temp_export"],
                                                                          strict=True)],
                                                   [c - s for c, s in zip(changed["gloo_push"], same["gloo_push"],
                                                                          strict=True)])
        ctx.log(f"{NAME}: {label} sync: gloo push {result['gloo_push']['median'] * 1e3:.0f} ms, temporary export "
                f"{result['temp_export']['median'] * 1e3:.0f} ms")
        return result
    finally:
        for side in sides.values():
            side.close()
        trainer.close()


def _rollout(ctx, cluster, smoke: bool) -> dict:
    """tokens/s with 1 and 2 Ray-placed engines (the local engine trains: the engines alone differ)."""
    import skyrl_sdk

    spec = SMOKE_MODEL if smoke else SYNC_MODELS["3M"]
    model_dir = make_model_dir(ctx.workdir / "model_dist_rollout", spec)
    prompts = make_prompts(2 if smoke else 8, 16 if smoke else 64, spec["vocab"])
    n, tokens = (2, 8) if smoke else (4, 64)
    backends = {f"{e}_engines": skyrl_sdk.Backend(model=str(model_dir), sampler="vllm", sampler_config={
        **SMALL_ENGINE, "placement": "ray", "engines": e, "ray_address": cluster.address}) for e in (1, 2)}
    try:
        for b in backends.values():
            b.sample(prompts, {"max_tokens": 2, "stop": []}, num_samples=n)  # engines start, weights pushed
        wall, _ = alternate({k: (lambda b=b: b.sample(prompts, {"max_tokens": tokens, "stop": [], "seed": 1},
                                                     num_samples=n)) for k, b in backends.items()},
                            reps=1 if smoke else 3, warmup=0)
        total = len(prompts) * n * tokens
        return {"prompts": len(prompts), "samples": n, "new_tokens": tokens, "parameters": num_parameters(spec),
                "tokens_per_s": {k: summary([total / s for s in v]) for k, v in wall.items()},
                "two_over_one": ratio_summary(wall["1_engines"], wall["2_engines"])}
    finally:
        for b in backends.values():
            b.close()


def _train_once(backend, batch, started: threading.Event, finished: list) -> None:
    started.set()
    t0 = time.perf_counter()
    backend.forward_backward(batch, "cross_entropy")
    finished.append(time.perf_counter() - t0)


def _overlap(ctx, cluster, smoke: bool) -> dict:
    """Latency of a sample that starts during a long forward_backward, with and without overlap."""
    import skyrl_sdk
    from skyrl_sdk.testing import make_sft_data

    spec = SMOKE_MODEL if smoke else SYNC_MODELS["3M"]
    model_dir = make_model_dir(ctx.workdir / "model_dist_overlap", spec)
    batch = make_sft_data([64] * (8 if smoke else 48), vocab=spec["vocab"])
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    out = {}
    for overlap in (True, False):
        b = skyrl_sdk.Backend(model=str(model_dir), engine="fsdp",
                              engine_config={"launcher": "ray", "world_size": 2, "ray_address": cluster.address},
                              sampler="vllm", sampler_config={**SMALL_ENGINE, "placement": "ray", "engines": 2,
                                                              "ray_address": cluster.address, "overlap": overlap})
        try:
            b.sample(prompt, {"max_tokens": 8, "stop": []})
            alone, during, train = [], [], []
            for _ in range(1 if smoke else 3):
                t0 = time.perf_counter()
                b.sample(prompt, {"max_tokens": 8, "stop": []})
                alone.append(time.perf_counter() - t0)
                started, finished = threading.Event(), []
                thread = threading.Thread(target=_train_once, args=(b, batch, started, finished))
                thread.start()
                started.wait()
                time.sleep(0.2)  # the training call holds the trainer now
                t0 = time.perf_counter()
                b.sample(prompt, {"max_tokens": 8, "stop": []})
                during.append(time.perf_counter() - t0)
                thread.join()
                train.append(finished[0])
            key = "overlap" if overlap else "no_overlap"
            out[key] = {"sample_alone_s": summary(alone), "sample_during_training_s": summary(during),
                        "training_call_s": summary(train),
                        "waited_s": summary([d - a for d, a in zip(during, alone, strict=True)])}
            ctx.log(f"{NAME}: {key}: a sample during a {summary(train)['median']:.1f} s training call took "
                    f"{summary(during)['median']:.2f} s (alone {summary(alone)['median']:.2f} s)")
        finally:
            b.close()
    return out


def run(ctx) -> dict:
    why = available()
    if why is not None:
        return {"status": why}
    from skyrl_sdk_ray.local_cluster import LoopbackCluster

    reps = 1 if ctx.smoke else 3
    models = {"smoke": SMOKE_MODEL} if ctx.smoke else SYNC_MODELS
    result = {"status": "ok", "sync": [_sync(ctx, label, spec, reps) for label, spec in models.items()]}
    with LoopbackCluster(nodes=2, cpus_per_node=3) as cluster:
        try:
            result["rollout"] = _rollout(ctx, cluster, ctx.smoke)
            result["overlap"] = _overlap(ctx, cluster, ctx.smoke)
        finally:
            import ray

            ray.shutdown()
    return result


def table(result: dict) -> list[str]:
    if result.get("status") != "ok":
        return [str(result.get("status"))]
    lines = ["| model | bytes | gloo push (ms) | temporary export (ms) | export / push |", "|---|---|---|---|---|"]
    for r in result["sync"]:
        lines.append(f"| {r['parameters'] / 1e6:.1f}M | {r['bytes'] / 2**20:.1f} MiB | "
                     f"{r['gloo_push']['median'] * 1e3:.0f} ({r['gloo_push']['min'] * 1e3:.0f}-"
                     f"{r['gloo_push']['max'] * 1e3:.0f}) | {r['temp_export']['median'] * 1e3:.0f} "
                     f"({r['temp_export']['min'] * 1e3:.0f}-{r['temp_export']['max'] * 1e3:.0f}) | "
                     f"{r['export_over_push']['median']:.1f} |")
    ro = result["rollout"]
    lines += ["", f"rollout: {ro['prompts']} prompts x {ro['samples']} samples x {ro['new_tokens']} tokens, "
                  f"{ro['parameters'] / 1e6:.1f}M parameters", "", "| engines | tokens/s |", "|---|---|"]
    for k, s in ro["tokens_per_s"].items():
        lines.append(f"| {k.split('_')[0]} | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) |")
    lines += ["", "| overlap | training call (s) | sample alone (s) | sample during training (s) |", "|---|---|---|---|"]
    for k, o in result["overlap"].items():
        lines.append(f"| {k} | {o['training_call_s']['median']:.2f} | {o['sample_alone_s']['median']:.2f} | "
                     f"{o['sample_during_training_s']['median']:.2f} |")
    return lines


def targets(result: dict) -> list[dict]:
    return []
