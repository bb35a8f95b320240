"""Memory per extra LoRA client in a fresh process; prints one JSON line on stdout.

``--mode shared``: one SharedBase, clients added one at a time (each runs one
forward_backward + optim_step, so its gradients and AdamW state exist). ``--mode solo``: one
LoRA Backend per client (what the server did before sharing). RSS after each client.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json

from .common import ADAM, make_sft_rows, proc_status, rows_to_datums, set_threads


def _rss() -> int:
    """RSS after returning freed heap pages to the OS (else allocator slack dominates the deltas)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc_status("VmRSS")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--mode", choices=("shared", "solo"), default="shared")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    from skyrl_sdk import Backend, SharedBase

    with open(args.model + "/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    datums = rows_to_datums(make_sft_rows([64, 64], vocab, seed=1))
    start = _rss()
    base = SharedBase(args.model) if args.mode == "shared" else None
    after_base = _rss()
    rss, clients = [], []
    for i in range(args.clients):
        lora = {"rank": args.rank, "seed": i}
        client = base.backend(lora) if base is not None else Backend(args.model, lora=lora)
        client.forward_backward(datums, "cross_entropy")
        client.optim_step(ADAM)
        clients.append(client)
        rss.append(_rss())
    stats = base.stats() if base is not None else None
    print(json.dumps({"mode": args.mode, "start_rss": start, "after_base_rss": after_base, "rss": rss,
                      "adapter_bytes": [a["bytes"] for a in stats["adapters"]] if stats else None,
                      "base_bytes": stats["base_bytes"] if stats else None}))


if __name__ == "__main__":
    main()
