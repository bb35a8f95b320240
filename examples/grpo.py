"""GRPO on any local Hugging Face model (or the built-in tiny one): docs/rl.md as a script.

    python examples/grpo.py                                  # tiny model, seconds on an idle CPU
    python examples/grpo.py --model ./my-hf-model --lora-rank 16 --loss ppo --steps 200

Each step samples a group of completions per prompt, rewards them, turns group-relative
advantages into datums (skyrl_sdk.rl), and takes one forward_backward + optim_step. Replace
``reward`` and ``make_prompt`` with your task.
"""

from __future__ import annotations

import argparse
import random

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.rl import datum_from_sample, group_advantages

LOSS_CONFIGS = {
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0},
}


def make_prompt(rng: random.Random) -> str:
    return f"{rng.randint(0, 999)}?"


def reward(text: str) -> float:
    """Answer with four digits: the fraction of the four answer characters that are digits."""
    return sum(c.isdigit() for c in text[:4]) / 4


def encode_prompt(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return [tok.bos_token_id, *ids] if tok.bos_token_id is not None else ids


def run(args: argparse.Namespace) -> list[float]:
    lora = types.LoraConfig(rank=args.lora_rank) if args.lora_rank else None
    engine_config = {"device": args.device}
    mean_rewards = []
    with skyrl_sdk.Backend(model=args.model, lora=lora, seed=args.seed, engine_config=engine_config) as backend:
        tok = backend.tokenizer
        rng = random.Random(args.seed)
        sampling = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[tok.eos_token_id])
        adam = types.AdamParams(learning_rate=args.lr)
        for step in range(args.steps):
            prompts = [encode_prompt(tok, make_prompt(rng)) for _ in range(args.groups)]
            outputs = backend.sample(prompts, sampling, num_samples=args.group_size)
            data, rewards = [], []
            for prompt, out in zip(prompts, outputs, strict=True):
                group = [reward(tok.decode(s.tokens, skip_special_tokens=True)) for s in out.sequences]
                rewards += group
                advantages = group_advantages(group)
                data += [datum_from_sample(prompt, s, a) for s, a in zip(out.sequences, advantages, strict=True)
                         if a != 0 and s.tokens]
            metrics = {}
            if data:
                fwd = backend.forward_backward(data, args.loss, LOSS_CONFIGS[args.loss])
                metrics = {**fwd.metrics, **backend.optim_step(adam).metrics}
            mean_rewards.append(sum(rewards) / len(rewards))
            print(f"step {step:3d}  reward {mean_rewards[-1]:+.3f}  datums {len(data):3d}  "
                  f"clip_fraction {metrics.get('clip_fraction:mean', 0.0):.3f}  "
                  f"grad_norm {metrics.get('grad_norm', 0.0):.3f}", flush=True)
        if args.out:
            print("weights:", backend.save_weights_for_sampler(args.out, overwrite=True).path)
    return mean_rewards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face model directory")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full)")
    parser.add_argument("--loss", choices=sorted(LOSS_CONFIGS), default="importance_sampling")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--groups", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="save the trained weights here (a HF model directory)")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
