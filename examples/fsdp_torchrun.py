"""Supervised training with the FSDP engine under torchrun (rank 0 drives, the others serve).

    torchrun --standalone --nproc-per-node 2 examples/fsdp_torchrun.py               # CPU: gloo
    torchrun --standalone --nproc-per-node 8 examples/fsdp_torchrun.py --model ./my-hf-model --device cuda

Needs the FSDP plugin (pip install -e plugins/skyrl-sdk-fsdp). The task is the demo's:
reverse a digit string ("4071>" -> "1704"); the loss per answer token falls as it learns.
"""

from __future__ import annotations

import argparse
import os

import skyrl_sdk_fsdp

skyrl_sdk_fsdp.worker_main()  # ranks != 0 serve rank 0 from here and exit when it is done

import skyrl_sdk  # noqa: E402  (only rank 0 gets here)
from skyrl_sdk import types  # noqa: E402
from skyrl_sdk.cli.demo import ReverseTask  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face model directory")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda' (rank r uses cuda:r)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=None, help="save the trained weights here (a HF model directory)")
    args = parser.parse_args()

    adam = types.AdamParams(learning_rate=3e-3, beta2=0.98, grad_clip_norm=1.0)
    with skyrl_sdk.Backend(model=args.model, engine="fsdp", engine_config={"device": args.device}) as backend:
        print(f"rank {os.environ.get('RANK')} of {backend.engine.world_size} drives the training", flush=True)
        task = ReverseTask(backend.tokenizer, seed=0)
        for step in range(args.steps):
            data = [task.sft_datum() for _ in range(args.batch_size)]
            tokens = sum(float(d.loss_fn_inputs["weights"].array.sum()) for d in data)
            out = backend.forward_backward(data, "cross_entropy")
            grad_norm = backend.optim_step(adam).metrics["grad_norm"]
            print(f"step {step:3d}  loss per answer token {out.metrics['loss:sum'] / tokens:.3f}  "
                  f"grad_norm {grad_norm:.3f}", flush=True)
        if args.out:
            print("weights:", backend.save_weights_for_sampler(args.out, overwrite=True).path, flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
