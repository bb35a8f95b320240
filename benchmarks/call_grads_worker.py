"""One setting of the pending_grads memory measurement in a fresh process; prints one JSON line.

Per run: loads the model, runs one ``forward_backward`` (its gradients are then pending),
resets the peak-RSS mark, runs a second one on top of them and reports the peak growth and
the size of the pending gradients. Several runs in one process (smoke mode) share its memory.
"""

from __future__ import annotations

import argparse
import json

from .common import make_sft_rows, proc_status, rows_to_datums, set_threads
from .memory_worker import reset_peak


def measure(model: str, lora, keep: bool, batch: int, seq: int) -> dict:
    from skyrl_sdk import Backend

    with open(model + "/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    first, second = (rows_to_datums(make_sft_rows([seq] * batch, vocab, seed=s)) for s in (3, 4))
    with Backend(model=model, lora=lora, engine_config={"keep_grads_on_error": keep}) as backend:
        backend.forward_backward(first)
        grads = [p.grad for _, p in backend.engine.runner.named_trainable() if p.grad is not None]
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        del grads
        base = reset_peak()
        backend.forward_backward(second)
        peak = proc_status("VmHWM")
    return {"lora": lora, "keep": keep, "grad_bytes": grad_bytes, "baseline_bytes": base,
            "peak_delta_bytes": peak - base}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--runs", required=True, help="JSON list of [lora, keep, batch, seq], run in this order")
    args = p.parse_args()
    set_threads(args.threads)
    print(json.dumps([measure(args.model, lora, bool(keep), batch, seq)
                      for lora, keep, batch, seq in json.loads(args.runs)]))


if __name__ == "__main__":
    main()
