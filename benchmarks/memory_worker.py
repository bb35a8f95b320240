"""One side of the memory benchmark in a fresh process; prints one JSON line on stdout."""

from __future__ import annotations

import argparse
import gc
import json
import time

from .common import HandLoop, SdkSide, make_sft_rows, proc_status, rows_to_datums, set_threads


def reset_peak() -> int:
    """Reset the peak-RSS mark to the current RSS; return the current RSS in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def measure(side: str, model: str, rows, engine_config: dict | None = None) -> dict:
    """Load one side, reset the peak, run one forward+backward, report the peak over the load."""
    import torch

    if side == "sdk":
        sdk = SdkSide(model, engine_config or {})
        datums = rows_to_datums(rows)
        run = lambda: sdk.forward_backward(datums)  # noqa: E731
    else:
        hand = HandLoop(model)
        run = lambda: hand.forward_backward(rows)  # noqa: E731
    base = reset_peak()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    peak = proc_status("VmHWM")
    return {"side": side, "baseline_bytes": base, "peak_bytes": peak, "peak_delta_bytes": peak - base,
            "seconds": seconds, "torch_threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sides", default="sdk")
    p.add_argument("--engine-config", default="{}")
    args = p.parse_args()
    set_threads(args.threads)
    with open(args.model + "/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rows = make_sft_rows([args.seq] * args.batch, vocab, seed=3)
    results = []
    for side in args.sides.split(","):
        results.append(measure(side, args.model, rows, json.loads(args.engine_config)))
        gc.collect()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
