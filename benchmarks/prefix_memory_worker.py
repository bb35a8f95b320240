"""One side of one prefix-memory cell in a fresh process; prints one JSON line on stdout.

The batch: one prompt of ``--prompt-len`` random tokens, ``--group`` samples each continuing it
with ``--suffix`` random tokens (``cross_entropy`` on every position). The side builds a
``Backend`` with prefix sharing on or off, runs one small call (so that one-time allocations and
sharing's self-test are not counted), resets the kernel's peak-RSS mark, runs one
``forward_backward`` of the batch and reports the peak (``VmHWM``) over the RSS before it.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .common import proc_status, set_threads
from .memory_worker import reset_peak


def batch(prompt_len: int, group: int, suffix: int, vocab: int, seed: int = 0) -> list:
    from skyrl_sdk import types

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, prompt_len)
    data = []
    for _ in range(group):
        seq = np.concatenate([prompt, rng.integers(0, vocab, suffix + 1)])
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={"target_tokens": seq[1:]}))
    return data


def measure(model: str, shared: bool, prompt_len: int, group: int, suffix: int) -> dict:
    import skyrl_sdk

    backend = skyrl_sdk.Backend(model=model, engine_config={"prefix_sharing": shared})
    vocab = backend.vocab_size
    data = batch(prompt_len, group, suffix, vocab)
    backend.forward_backward(batch(32, 2, suffix, vocab, seed=1), "cross_entropy")  # warm up (and self-test)
    backend.zero_grad()
    plan = backend.engine.runner.plan(data)
    base = reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    backend.forward_backward(data, "cross_entropy")
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = proc_status("VmHWM")
    return {"side": "shared" if shared else "unshared", "peak_delta_bytes": peak - base, "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "micro_batches": len(plan), "shared_rows": sum(mb.prefix is not None for mb in plan),
            "tokens": sum(d.model_input.length for d in data)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--suffix", type=int, default=4)
    p.add_argument("--side", choices=("shared", "unshared"), required=True)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    print(json.dumps(measure(args.model, args.side == "shared", args.prompt_len, args.group, args.suffix)))


if __name__ == "__main__":
    main()
