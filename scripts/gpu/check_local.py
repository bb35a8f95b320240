"""The local engine on the device: dtypes, attention kernels, throughput metrics, the trainer's
offload to host memory and back, host syncs per micro-batch, the kept-gradient buffer's memory.

    python -m scripts.gpu.check_local --device cuda --out local.json --workdir /tmp/w
"""

from __future__ import annotations

import math

import numpy as np
import torch

import skyrl_sdk
from scripts.gpu.checks import VOCAB, Checks, datums, model_dir, parse, require
from skyrl_sdk import types
from skyrl_sdk.models import attention

ADAM = types.AdamParams(learning_rate=1e-4)


def logprobs(out) -> np.ndarray:
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def main() -> int:
    args = parse(__doc__)
    checks = Checks(args.device)
    model = model_dir(args.workdir, args.device)
    vocab = VOCAB[args.device]
    data = datums(vocab, (512, 300, 700, 128) if checks.cuda else (40, 17, 60), seed=0)
    base = {"device": args.device}

    for dtype in ("float32", "bfloat16"):
        with checks.case(f"training step in {dtype}") as d:
            with skyrl_sdk.Backend(model=model, engine_config={**base, "dtype": dtype}) as b:
                losses = []
                for _ in range(2):
                    out = b.forward_backward(data, "cross_entropy")
                    losses.append(out.metrics["loss:sum"])
                    b.optim_step(ADAM)
                d.update(losses=losses, metrics={k: v for k, v in out.metrics.items() if "second" in k or "mfu" in k})
                require(all(math.isfinite(x) for x in losses), f"a loss is not finite: {losses}")
                require(out.metrics["tokens_per_second:mean"] > 0, "no tokens per second")
                if checks.cuda:
                    d["mfu"] = out.metrics.get("mfu:mean")
                    require(d["mfu"] is None or 0 < d["mfu"] < 1, f"MFU {d['mfu']} is not a fraction")

    with checks.case("attention: eager equals sdpa within 1e-5 (float32)") as d:
        got = {}
        for kernel in ("sdpa", "eager"):
            with skyrl_sdk.Backend(model=model, engine_config={**base, "attn_implementation": kernel}) as b:
                got[kernel] = logprobs(b.forward(data, "cross_entropy"))
        d["max_abs_diff"] = float(np.abs(got["eager"] - got["sdpa"]).max())
        require(d["max_abs_diff"] <= 1e-5, f"eager and sdpa differ by {d['max_abs_diff']}")

    with checks.case("attention: flash_attention_2 runs where it can, is refused by name where it cannot") as d:
        reason = attention.unavailable_reason("flash_attention_2", args.device)
        d["unavailable"] = reason
        if reason is not None:
            try:
                skyrl_sdk.Backend(model=model, engine_config={**base, "attn_implementation": "flash_attention_2"})
            except skyrl_sdk.errors.InputError as exc:
                d["refused"] = str(exc)
                require("attn_implementation" in str(exc) and "flash_attention_2" in str(exc), str(exc))
            else:
                raise AssertionError("flash_attention_2 was accepted where it cannot run")
        else:  # packed rows run as varlen attention: they equal the padded sdpa layout
            cfg = {**base, "dtype": "bfloat16", "prefix_sharing": False}
            with skyrl_sdk.Backend(model=model, engine_config={**cfg, "attn_implementation": "sdpa"}) as b:
                ref = logprobs(b.forward(data, "cross_entropy"))
            with skyrl_sdk.Backend(model=model, engine_config={**cfg, "attn_implementation": "flash_attention_2",
                                                               "batching": "pack"}) as b:
                packed = b.forward(data, "cross_entropy")
                d["pack_tokens_per_second"] = packed.metrics["tokens_per_second:mean"]
            d["max_abs_diff_bf16"] = float(np.abs(logprobs(packed) - ref).max())
            require(d["max_abs_diff_bf16"] < 0.1, f"packed flash and sdpa differ by {d['max_abs_diff_bf16']}")

    with checks.case("throughput metrics on forward_backward, forward and sample") as d:
        with skyrl_sdk.Backend(model=model, engine_config={**base, "dtype": "bfloat16"}) as b:
            fb = b.forward_backward(data, "cross_entropy").metrics
            fw = b.forward(data, "cross_entropy").metrics
            sample = b.sample([list(range(5, 69))], {"max_tokens": 32, "stop": []}, num_samples=4)[0].metrics
        for name, m in (("forward_backward", fb), ("forward", fw), ("sample", sample)):
            d[name] = {k: m[k] for k in ("tokens_per_second:mean", "mfu:mean", "seconds:sum") if k in m}
            require(m["tokens_per_second:mean"] > 0, f"{name}: no tokens per second")
        d["peak_known"] = "mfu:mean" in fb

    with checks.case("trainer offload to host memory and back (offload_while_sampling)") as d:
        with skyrl_sdk.Backend(model=model, engine_config={**base, "offload_while_sampling": True}) as b:
            b.forward_backward(data, "cross_entropy")
            b.optim_step(ADAM)
            b.forward_backward(data, "cross_entropy")
            before = {n: p.detach().clone() for n, p in b.engine.loaded.module.named_parameters()}
            used = torch.cuda.memory_allocated() if checks.cuda else 0
            b.engine.offload_to_host()
            offload = b.engine.trainer_offload
            d["moved_gib"] = offload.last_bytes / 2**30
            if checks.cuda:
                d["freed_gib"] = (used - torch.cuda.memory_allocated()) / 2**30
                require(d["freed_gib"] >= 0.9 * d["moved_gib"], f"moved {d['moved_gib']:.2f} GiB, freed {d}")
            b.engine.reload_to_device()
            after = dict(b.engine.loaded.module.named_parameters())
            require(all(torch.equal(before[n], after[n].detach()) for n in before), "the weights changed in the trip")
            b.optim_step(ADAM)  # the moments came back where the fused step wants them

    name = "no host sync per micro-batch (CUDA's sync debug mode)"
    if checks.on_cuda(name):
        _host_syncs(checks, name, model, base, vocab, data)
    name = "keep_grads_on_error: the kept buffer's memory, and per call"
    if checks.on_cuda(name):
        _kept_buffer(checks, name, model, base, data)
    return checks.write(args.out, model=model)


def _host_syncs(checks, name, model, base, vocab, data) -> None:
    with checks.case(name) as d:
        import warnings

        counts = {}
        with skyrl_sdk.Backend(model=model, engine_config={**base, "micro_batch_tokens": 1024,
                                                           "prefix_sharing": False}) as b:
            b.forward_backward(data, "cross_entropy")
            for n in (2, 8):
                batch = datums(vocab, [1000] * n, seed=n)
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    b.forward_backward(batch, "cross_entropy")
                torch.cuda.set_sync_debug_mode("default")
                counts[n] = len(caught)
                d[f"syncs_{n}_micro_batches"] = [str(w.message)[:120] for w in caught][:12]
        d["counts"] = counts
        # transformers reads one boolean per forward (packed-sequence detection): allow one per micro-batch
        require(counts[8] - counts[2] <= 6, f"host syncs grow with micro-batches beyond transformers': {counts}")


def _kept_buffer(checks, name, model, base, data) -> None:
    with checks.case(name) as d:
        with skyrl_sdk.Backend(model=model, engine_config=base) as b:
            grads = sum(p.numel() * p.element_size() for p in b.engine.loaded.module.parameters())
            peaks = {}
            for keep in (True, False):
                b.zero_grad()
                b.forward_backward(data, "cross_entropy")
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
                b.forward_backward(data, "cross_entropy", keep_grads_on_error=keep)
                peaks[keep] = (torch.cuda.max_memory_allocated() - start) / 2**30
        d.update(peak_gib_keep=peaks[True], peak_gib_drop=peaks[False], gradient_buffer_gib=grads / 2**30)
        require(peaks[True] - peaks[False] >= 0.8 * grads / 2**30, f"the kept buffer did not show: {d}")


if __name__ == "__main__":
    raise SystemExit(main())
