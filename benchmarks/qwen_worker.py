"""One run of the ~0.5B benchmark in a fresh process; prints one JSON line on stdout.

    python -m benchmarks.qwen_worker --make-model DIR [--smoke]        # write the random-weight model
    python -m benchmarks.qwen_worker --model DIR --mode lora|full [--device cpu|cuda] ...

A run: build the Backend (bf16-mixed), then ``steps`` x (forward_backward + optim_step),
save_weights_for_sampler, sample. Memory: the process's peak RSS (``VmHWM``) on CPU;
``torch.cuda.max_memory_allocated`` on CUDA (the RSS is reported too). Every timed phase
ends with ``torch.cuda.synchronize()`` on CUDA (kernels are asynchronous).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from .common import TINY_ASSETS, make_sft_rows, proc_status, rows_to_datums, set_threads

#: Qwen2.5-0.5B's shape (its config.json, random weights): 494M parameters, tied embeddings.
QWEN_0P5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: Smoke mode: the same architecture at toy size.
QWEN_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def qwen_config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                       architectures=["Qwen2ForCausalLM"], dtype="bfloat16")


def make_model(directory: Path, shape: dict, seed: int = 0) -> dict:
    """Random weights (seeded), saved in bf16 like the real checkpoint, with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    if (directory / "config.json").is_file():
        return {"directory": str(directory), "created": False}
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(qwen_config(shape), dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(directory))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_ASSETS / name, directory / name)
    return {"directory": str(directory), "created": True, "parameters": params,
            "seconds": time.perf_counter() - t0}


class Clock:
    """Wall time of phases, synchronizing the device first (CUDA work is asynchronous)."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn):
        self.sync()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        return result, time.perf_counter() - t0


def run(args) -> dict:
    import torch

    from skyrl_sdk import Backend, types

    clock = Clock(args.device)
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_start = proc_status("VmRSS")
    config = json.loads((Path(args.model) / "config.json").read_text())
    engine_config = {"device": args.device, "dtype": "bfloat16", "gradient_checkpointing": args.checkpointing,
                     "micro_batch_tokens": args.batch * args.seq}
    lora = types.LoraConfig(rank=16, alpha=32.0) if args.mode == "lora" else None
    backend, load_s = clock.time(lambda: Backend(model=args.model, lora=lora, engine_config=engine_config))
    info = backend.get_info()
    rss_loaded = proc_status("VmRSS")
    rows = make_sft_rows([args.seq] * args.batch, config["vocab_size"], seed=11)
    datums = rows_to_datums(rows)
    adam = types.AdamParams(learning_rate=1e-5 if lora is None else 1e-4)
    steps, losses = [], []
    for _ in range(args.steps):
        out, fb_s = clock.time(lambda: backend.forward_backward(datums, "cross_entropy"))
        _, opt_s = clock.time(lambda: backend.optim_step(adam))
        losses.append(out.metrics["loss:sum"] / max(1.0, float(sum(r["weights"].sum() for r in rows))))
        steps.append({"forward_backward_s": fb_s, "optim_step_s": opt_s})
    with tempfile.TemporaryDirectory(prefix="skyrl-qwen-", dir=args.scratch) as tmp:
        _, export_s = clock.time(lambda: backend.save_weights_for_sampler(Path(tmp) / "sampler"))
        files = list((Path(tmp) / "sampler").glob("*.safetensors"))
        export_bytes = sum(f.stat().st_size for f in files)
    prompt = list(range(40, 40 + args.prompt_tokens))
    params = types.SamplingParams(max_tokens=args.sample_tokens, seed=0, temperature=1.0)
    samples, sample_s = clock.time(lambda: backend.sample([prompt], params, num_samples=1))
    backend.close()
    result = {
        "mode": args.mode, "device": args.device, "dtype": "bfloat16 compute, float32 masters",
        "gradient_checkpointing": args.checkpointing, "batch": args.batch, "seq_len": args.seq,
        "parameters": info.num_parameters, "trainable_parameters": info.num_trainable_parameters,
        "torch_threads": torch.get_num_threads(), "load_s": load_s, "steps": steps,
        "loss_per_token": losses, "export_s": export_s, "export_bytes": export_bytes,
        "sample_s": sample_s, "sampled_tokens": len(samples[0].sequences[0].tokens),
        "rss_start_bytes": rss_start, "rss_after_load_bytes": rss_loaded, "peak_rss_bytes": proc_status("VmHWM"),
    }
    if clock.cuda:
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--make-model", default=None, help="write the random-weight model directory here and exit")
    p.add_argument("--smoke", action="store_true", help="with --make-model: the toy-size Qwen2")
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--scratch", default=None, help="where the sampler export is written (a temp dir in it)")
    return p


def main() -> None:
    args = parser().parse_args()
    set_threads(args.threads)
    if args.make_model:
        print(json.dumps(make_model(Path(args.make_model), QWEN_SMOKE if args.smoke else QWEN_0P5B)))
        return
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
