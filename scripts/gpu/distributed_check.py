"""Ray placement on GPUs, in one go: fsdp ranks and vLLM engines as Ray actors, weights pushed
through vLLM's weight-transfer API, checked and measured; one JSON document out.

    python scripts/gpu/distributed_check.py --world-size 2 --engines 2 --out result.json          # split
    python scripts/gpu/distributed_check.py --world-size 4 --engines 4 --colocate --out c.json    # colocated
    RAY_ADDRESS=head:6379 python scripts/gpu/distributed_check.py --world-size 8 --engines 4 --tp 2 --out two.json

Per step (3 steps, full fine-tuning, then LoRA): a training step, the next sample's wait for the
weights (``sampler.last_sync``), each engine's logprobs of its own samples against ``forward``
(bf16: reported, with a loose bound that catches a sync that did not happen), rollout tokens/s
over all engines, and a sample issued during a training call (how long it waited). The model is
built from a config (no hub needed): ``--size 0.5b`` or ``1.5b`` (Qwen2-shaped, random weights),
or ``--model DIR`` for a real one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SIZES = {  # Qwen2-shaped
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=32768),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=32768),
}
#: bf16 logprobs of vLLM's kernels against the trainer's: a sync that did not happen shows as ~1
BF16_BOUND = 0.25


def build_model(size: str, directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from skyrl_sdk.models import load_tokenizer

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(str(directory))
    load_tokenizer("tiny").save_pretrained(str(directory))  # any tokenizer within the vocabulary
    return directory


def datum(tokens):
    from skyrl_sdk import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def _train(backend, batch, started: threading.Event) -> None:
    started.set()
    backend.forward_backward(batch, "cross_entropy")


def check(args, model: str, lora: dict | None) -> dict:
    import skyrl_sdk
    import skyrl_sdk.sampling
    from skyrl_sdk import types

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    batch = [datum(rng.integers(3, 300, size=256).tolist()) for _ in range(args.batch)]
    sampler_config = {"placement": "ray", "engines": args.engines, "tensor_parallel_size": args.tp,
                      "colocate": args.colocate, "transfer": args.transfer, "gpu_memory_utilization": args.gpu_mem}
    if args.colocate:
        sampler_config["sleep_level"] = 1
    t0 = time.perf_counter()
    b = skyrl_sdk.Backend(model=model, lora=lora, engine="fsdp",
                          engine_config={"launcher": "ray", "world_size": args.world_size, "dtype": "bfloat16",
                                         "gradient_checkpointing": True},
                          sampler="vllm", sampler_config=sampler_config)
    out = {"lora": lora, "sampler_config": sampler_config, "steps": []}
    try:
        b.sample(prompts[:1], {"max_tokens": 1})
        out["start_s"] = time.perf_counter() - t0
        out["sampler"] = b.sampler.describe()
        for step in range(3):
            t = time.perf_counter()
            b.forward_backward(batch, "cross_entropy")
            b.optim_step(types.AdamParams(learning_rate=1e-5))
            train_s = time.perf_counter() - t
            t = time.perf_counter()
            b.sample(prompts, {"max_tokens": args.new_tokens, "temperature": 1.0, "stop": [], "seed": step},
                           num_samples=args.samples)
            rollout_s = time.perf_counter() - t
            sync = dict(b.sampler.last_sync or {})
            request = skyrl_sdk.sampling.SampleRequest(
                prompts=[np.asarray(p, dtype=np.int64) for p in prompts[:2]],
                sampling_params=types.SamplingParams(max_tokens=16, seed=step), num_samples=2)
            diffs = {}
            for slot in b.sampler.fleet.slots:  # every engine's own samples against forward
                worst = 0.0
                for p, o in zip(prompts[:2], slot.handle.call("sample", request).result(), strict=True):
                    for s in o.sequences:
                        full = p + list(s.tokens)
                        want = b.forward([datum(full)], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()
                        worst = max(worst, float(np.abs(np.asarray(s.logprobs) - want[len(p) - 1:]).mean()))
                diffs[f"engine_{slot.index}"] = worst
            out["steps"].append({"train_s": train_s, "sync": sync, "rollout_s": rollout_s,
                                 "rollout_tokens_per_s": len(prompts) * args.samples * args.new_tokens / rollout_s,
                                 "mean_abs_logprob_diff": diffs})
            print(json.dumps(out["steps"][-1]), file=sys.stderr, flush=True)
        waited = []
        for _ in range(2):  # a sample issued during a training call
            started = threading.Event()
            thread = threading.Thread(target=_train, args=(b, batch, started))
            thread.start()
            started.wait()
            time.sleep(0.5)
            t = time.perf_counter()
            b.sample(prompts[:1], {"max_tokens": 8})
            waited.append(time.perf_counter() - t)
            thread.join()
        out["sample_during_training_s"] = waited
        out["ok"] = all(v < BF16_BOUND for s in out["steps"] for v in s["mean_abs_logprob_diff"].values())
    finally:
        b.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--transfer", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--gpu-mem", type=float, default=0.4, help="vLLM's gpu_memory_utilization")
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--model", default=None, help="a Hugging Face model directory instead of --size")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--no-lora", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model = args.model or str(build_model(args.size, Path(tempfile.gettempdir()) / f"skyrl-gpu-{args.size}"))
    result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "runs": []}
    status = 0
    for lora in ([None] if args.no_lora else [None, {"rank": 32}]):
        try:
            run = check(args, model, lora)
        except Exception as exc:  # recorded, and the status says so
            run = {"lora": lora, "error": f"{type(exc).__name__}: {exc}"}
        result["runs"].append(run)
        status |= 0 if run.get("ok") else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"out": str(args.out), "ok": status == 0}))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
