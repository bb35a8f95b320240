"""The vllm sampler on a CUDA GPU: logprobs against ``forward``, weights in sync after training
(full fine-tuning and LoRA), and the colocated memory plan (what vLLM holds awake and asleep,
and that samples stay right across sleep and wake). One JSON document; exit status 1 when a
float32 check misses the issue's bound (1e-3). Run by ``scripts/gpu_run.sh``.

    python plugins/skyrl-sdk-vllm/scripts/gpu_check.py --out checks.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks.common import make_model_dir  # noqa: E402

import skyrl_sdk  # noqa: E402
from skyrl_sdk import types  # noqa: E402

F32_BOUND = 1e-3
MODEL = dict(vocab=32000, hidden=1024, intermediate=2816, layers=12, heads=16, kv_heads=8, tie=False)


def forward_logprobs(backend, prompt, tokens) -> np.ndarray:
    full = list(prompt) + list(tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
    return backend.forward([datum], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]


def gaps(backend, prompts) -> dict:
    """|sampler logprob - forward logprob| over a group of samples per prompt."""
    out = backend.sample(prompts, {"max_tokens": 32, "seed": 3, "stop": []}, num_samples=4)
    diffs = np.concatenate([np.abs(np.array(s.logprobs) - forward_logprobs(backend, p, s.tokens))
                            for p, o in zip(prompts, out, strict=True) for s in o.sequences])
    return {"max": float(diffs.max()), "mean": float(diffs.mean())}


def train(backend, steps: int = 2) -> None:
    rng = np.random.default_rng(0)
    seq = rng.integers(3, MODEL["vocab"], 129).tolist()
    data = [types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]})]
    for _ in range(steps):
        backend.forward_backward(data, "cross_entropy")
        backend.optim_step(types.AdamParams(learning_rate=1e-3))


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def correctness(model_dir: Path, prompts) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for lora in (None, {"rank": 16}):
            t0 = time.perf_counter()
            with skyrl_sdk.Backend(model=str(model_dir), lora=lora, engine_config={"device": "cuda", "dtype": dtype},
                                   sampler="vllm", sampler_config={"gpu_memory_utilization": 0.3}) as b:
                before = gaps(b, prompts)
                train(b)
                after = gaps(b, prompts)
                rows.append({"dtype": dtype, "lora": lora is not None, "before_training": before,
                             "after_training": after, "last_sync": b.sampler.last_sync,
                             "sampler": b.sampler.describe(), "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def memory_plan(model_dir: Path, prompts) -> list[dict]:
    """Free GPU memory with the trainer alone, and after a sample with each sleep level (vLLM
    sleeps right after each call at levels 1 and 2), and that samples stay right after waking."""
    rows = []
    for level in (0, 1, 2):
        with skyrl_sdk.Backend(model=str(model_dir), engine_config={"device": "cuda", "dtype": "bfloat16"},
                               sampler="vllm",
                               sampler_config={"gpu_memory_utilization": 0.3, "sleep_level": level}) as b:
            train(b, steps=1)
            trainer_only = free_gib()
            first = gaps(b, prompts)
            after_sample = free_gib()
            train(b, steps=1)
            t0 = time.perf_counter()
            again = gaps(b, prompts)  # wakes vLLM (level 2: reloads every weight), then sleeps again
            rows.append({"sleep_level": level, "free_gib_trainer_only": trainer_only,
                         "free_gib_after_sample": after_sample,
                         "vllm_holds_gib_between_calls": trainer_only - after_sample,
                         "gap_first": first, "gap_after_step_and_wake": again,
                         "sample_after_step_s": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="checks.json")
    args = p.parse_args()
    assert torch.cuda.is_available(), "this script needs a CUDA GPU"
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, MODEL["vocab"], n).tolist() for n in (16, 64, 200)]
    with tempfile.TemporaryDirectory(prefix="skyrl-vllm-gpu-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", MODEL)
        doc = {"model": MODEL, "gpu": torch.cuda.get_device_name(), "correctness": correctness(model_dir, prompts),
               "memory_plan": memory_plan(model_dir, prompts)}
    failed = [r for r in doc["correctness"] if r["dtype"] == "float32"
              and max(r["before_training"]["max"], r["after_training"]["max"]) > F32_BOUND]
    failed += [r for r in doc["memory_plan"] if r["gap_after_step_and_wake"]["max"] > 0.1]  # bf16: a wrong
    doc["verdict"] = "met" if not failed else "NOT met"                                        # weight is >> 0.1
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"verdict: {doc['verdict']} ({args.out})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
