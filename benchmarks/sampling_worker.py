"""One side of the sampling memory benchmark in a fresh process; prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time

from .common import proc_status, set_threads
from .memory_worker import reset_peak
from .sampling_sides import PlainGenerate, SdkSampler, make_prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--side", choices=("sdk", "generate"), required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    with open(args.model + "/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    side = SdkSampler(args.model) if args.side == "sdk" else PlainGenerate(args.model)
    prompts = make_prompts(args.prompts, args.prompt_len, vocab)
    side.sample(prompts, 1, 2)  # warm-up: first-call allocations are not the batch's
    base = reset_peak()
    t0 = time.perf_counter()
    tokens = side.sample(prompts, args.samples, args.new_tokens)
    seconds = time.perf_counter() - t0
    peak = proc_status("VmHWM")
    print(json.dumps({"side": args.side, "peak_delta_bytes": peak - base, "seconds": seconds, "tokens": tokens}))


if __name__ == "__main__":
    main()
