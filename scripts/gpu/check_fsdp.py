"""The fsdp engine on the device: one rank per GPU (2 ranks on CPU) against the local engine,
FSDP2's CPU offload, a full checkpoint gathered to rank 0 and loaded back by the local engine,
and the throughput metrics of all ranks.

    python -m scripts.gpu.check_fsdp --device cuda --out fsdp.json --workdir /tmp/w
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

import skyrl_sdk
from scripts.gpu.checks import VOCAB, Checks, datums, free_gib, model_dir, parse, require
from skyrl_sdk import types

ADAM = types.AdamParams(learning_rate=1e-4)


def train(b, data, steps=2) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(b.forward_backward(data, "cross_entropy").metrics["loss:sum"])
        b.optim_step(ADAM)
    return losses


def main() -> int:
    args = parse(__doc__)
    checks = Checks(args.device)
    model = model_dir(args.workdir, args.device)
    vocab = VOCAB[args.device]
    data = datums(vocab, (512, 300, 700, 128) if checks.cuda else (40, 17, 60, 9), seed=1)
    world = torch.cuda.device_count() if checks.cuda else 2
    base = {"device": args.device, "world_size": world}
    tmp = Path(tempfile.mkdtemp(prefix="skyrl-gpu-fsdp-", dir=args.workdir))
    sharded: dict[str, object] = {}  # the first fsdp run's losses and free memory: cpu_offload's reference

    with checks.case(f"fsdp ({world} ranks) matches the local engine over 2 AdamW steps") as d:
        with skyrl_sdk.Backend(model=model, engine_config={"device": args.device}) as local:
            reference = train(local, data)
        with skyrl_sdk.Backend(model=model, engine="fsdp", engine_config=base) as b:
            got = train(b, data)
            sharded.update(losses=got, free_gib=free_gib() if checks.cuda else None)
            m = b.forward(data, "cross_entropy").metrics
            b.save_state(tmp / "full")
        d.update(local=reference, fsdp=got, tokens_per_second=m["tokens_per_second:mean"], mfu=m.get("mfu:mean"))
        np.testing.assert_allclose(got, reference, rtol=1e-4)
        if checks.cuda:
            require(m.get("mfu:mean") is None or 0 < m["mfu:mean"] < 1, f"MFU {m.get('mfu:mean')}")

    with checks.case("a full checkpoint (gathered to rank 0) loads into the local engine") as d:
        with skyrl_sdk.Backend(model=model, engine_config={"device": args.device}) as local:
            local.load_state(tmp / "full")
            d["next_loss"] = local.forward(data, "cross_entropy").metrics["loss:sum"]
        require(np.isfinite(d["next_loss"]), "no loss")

    with checks.case("cpu_offload: the same losses, less device memory") as d:
        require("losses" in sharded, "the run without cpu_offload failed")
        with skyrl_sdk.Backend(model=model, engine="fsdp", engine_config={**base, "cpu_offload": True}) as b:
            losses = train(b, data)
            free = free_gib() if checks.cuda else None
            b.save_state(tmp / "offloaded")  # shards in host memory go through the gather too
            b.load_state(tmp / "offloaded")  # and back into host-memory shards (the moments too)
            d["loss_after_load"] = train(b, data, steps=1)[0]
        d.update(losses=losses, without=sharded["losses"], free_gib=free, free_gib_without=sharded["free_gib"])
        np.testing.assert_allclose(losses, sharded["losses"], rtol=1e-4)
        if checks.cuda:
            require(free > sharded["free_gib"], f"cpu_offload left less free device memory: {d}")

    return checks.write(args.out, model=model, world_size=world)


if __name__ == "__main__":
    raise SystemExit(main())
