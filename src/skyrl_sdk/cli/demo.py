"""``skyrl-sdk demo``: supervised training, then RL, on the built-in tiny model, offline.

Task: reverse a short digit string (``"4071>" -> "1704"``). The demo trains with
``cross_entropy`` until the loss falls, then runs a few RL steps (sample -> reward ->
group-relative advantages -> Tinker ``ppo``) that raise the reward, exports the weights
with ``save_weights_for_sampler`` and prints a summary and what to try next (or JSON with
``--json``). It says what it does before the slow imports, and shows progress bars.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from tqdm.auto import tqdm

from .. import types
from .threads import apply as apply_threads

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SFT_ADAM = types.AdamParams(learning_rate=3e-3, beta1=0.9, beta2=0.98, weight_decay=0.01, grad_clip_norm=1.0)
RL_ADAM = types.AdamParams(learning_rate=5e-4, beta1=0.9, beta2=0.98, grad_clip_norm=1.0)


class ReverseTask:
    """Prompts and rewards for string reversal, tokenized by the tiny byte-level tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int, min_len: int = 2, max_len: int = 4) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.min_len, self.max_len = min_len, max_len

    def problem(self) -> tuple[str, str]:
        n = self.rng.randint(self.min_len, self.max_len)
        digits = "".join(self.rng.choice("0123456789") for _ in range(n))
        return digits + ">", digits[::-1]

    def prompt_tokens(self, prompt: str) -> list[int]:
        return [self.tok.bos_token_id] + self.tok.encode(prompt, add_special_tokens=False)

    def sft_datum(self) -> types.Datum:
        prompt, answer = self.problem()
        p = self.prompt_tokens(prompt)
        c = self.tok.encode(answer, add_special_tokens=False) + [self.tok.eos_token_id]
        full = p + c
        weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
        return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                           loss_fn_inputs={"target_tokens": full[1:], "weights": weights})

    def reward(self, completion: list[int], answer: str) -> float:
        """Fraction of answer characters in place, minus a penalty for a wrong length."""
        text = self.tok.decode([t for t in completion if t != self.tok.eos_token_id])
        hits = sum(a == b for a, b in zip(text, answer, strict=False))
        return hits / len(answer) - 0.1 * abs(len(text) - len(answer)) / len(answer)


def run_sft(backend: Any, task: ReverseTask, steps: int, batch_size: int, quiet: bool) -> list[float]:
    losses = []
    bar = tqdm(range(steps), desc="supervised", disable=quiet)
    for _ in bar:
        data = [task.sft_datum() for _ in range(batch_size)]
        out = backend.forward_backward(data, "cross_entropy")
        n = sum(float(np.sum(d.loss_fn_inputs["weights"].array)) for d in data)
        backend.optim_step(SFT_ADAM)
        losses.append(out.metrics["loss:sum"] / n)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def run_rl(backend: Any, task: ReverseTask, steps: int, groups: int, group_size: int, quiet: bool) -> list[float]:
    rewards = []
    bar = tqdm(range(steps), desc="rl", disable=quiet)
    params = types.SamplingParams(max_tokens=task.max_len + 1, temperature=1.0)
    for step in bar:
        problems = [task.problem() for _ in range(groups)]
        prompts = [task.prompt_tokens(p) for p, _ in problems]
        samples = backend.sample(prompts, attrs.evolve(params, seed=1000 + step), num_samples=group_size)
        data, step_rewards = [], []
        for prompt, (_, answer), out in zip(prompts, problems, samples, strict=True):
            group = [task.reward(s.tokens, answer) for s in out.sequences]
            baseline = float(np.mean(group))
            step_rewards.extend(group)
            for seq, r in zip(out.sequences, group, strict=True):
                if not seq.tokens or r == baseline:
                    continue
                full = prompt + seq.tokens
                n_prompt = len(prompt) - 1
                adv = (r - baseline) / (groups * group_size)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": [0.0] * n_prompt + seq.logprobs,
                        "advantages": [0.0] * n_prompt + [adv] * len(seq.tokens),
                    },
                ))
        rewards.append(float(np.mean(step_rewards)))
        if data:
            backend.forward_backward(data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
            backend.optim_step(RL_ADAM)
        bar.set_postfix(reward=f"{rewards[-1]:.3f}")
    return rewards


def greedy_eval(backend: Any, task: ReverseTask, problems: list[tuple[str, str]]) -> tuple[float, float]:
    """(mean reward, exact-match accuracy) of greedy answers on a fixed problem set."""
    outs = backend.sample([task.prompt_tokens(p) for p, _ in problems],
                          types.SamplingParams(max_tokens=task.max_len + 1, temperature=0.0))
    rewards, correct = [], 0
    for (_, answer), out in zip(problems, outs, strict=True):
        tokens = out.sequences[0].tokens
        rewards.append(task.reward(tokens, answer))
        correct += backend.tokenizer.decode([t for t in tokens if t != backend.tokenizer.eos_token_id]) == answer
    return float(np.mean(rewards)), correct / len(problems)


def run_demo(steps: int = 120, rl_steps: int = 16, out_dir: str = "skyrl-demo-out", seed: int = 0,
             batch_size: int = 32, quiet: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    from ..backend import Backend

    with Backend(model="tiny", seed=seed) as backend:
        if not quiet:
            print(f"model ready after {time.perf_counter() - t0:.1f}s; training...", file=sys.stderr, flush=True)
        task = ReverseTask(backend.tokenizer, seed)
        sft = run_sft(backend, task, steps, batch_size, quiet)
        eval_task = ReverseTask(backend.tokenizer, seed + 1)
        eval_set = [eval_task.problem() for _ in range(128)]
        before = greedy_eval(backend, task, eval_set)
        rl = run_rl(backend, task, rl_steps, groups=16, group_size=8, quiet=quiet)
        after = greedy_eval(backend, task, eval_set)
        saved = backend.save_weights_for_sampler(Path(out_dir) / "sampler_weights", overwrite=True)
    k = max(1, min(10, len(sft) // 5))
    q = max(1, len(rl) // 3)
    return {
        "sft_steps": steps,
        "rl_steps": rl_steps,
        "sft_loss_first": float(np.mean(sft[:k])),
        "sft_loss_last": float(np.mean(sft[-k:])),
        "rl_reward_first": float(np.mean(rl[:q])) if rl else None,
        "rl_reward_last": float(np.mean(rl[-q:])) if rl else None,
        "eval_reward_after_sft": before[0],
        "eval_reward_after_rl": after[0],
        "eval_accuracy_after_sft": before[1],
        "eval_accuracy_after_rl": after[1],
        "weights_dir": saved.path,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_threads": torch.get_num_threads(),
        "sft_loss_curve": [round(x, 4) for x in sft],
        "rl_reward_curve": [round(x, 4) for x in rl],
    }


def intro(steps: int, rl_steps: int) -> str:
    return (
        "skyrl-sdk demo: teach the built-in tiny model (random weights, CPU) to reverse digit strings\n"
        f"  ('4071>' -> '1704'): {steps} supervised steps (cross_entropy), then {rl_steps} RL steps\n"
        "  (a group of sampled answers per string -> reward -> group-relative advantages -> ppo).\n"
        "  reward: the fraction of answer characters in the right place, minus a penalty for a wrong\n"
        "  length; accuracy: the fraction of answers exactly right (both on 128 held-out strings).\n"
        "Loading torch and the model..."
    )


def summary(result: dict[str, Any]) -> str:
    """The results in words, then what to try next with the exported weights."""
    weights = result["weights_dir"]
    lines = [
        "",
        f"skyrl-sdk demo: done in {result['seconds']}s",
        f"  supervised  loss per answer token   {result['sft_loss_first']:.3f} -> {result['sft_loss_last']:.3f}"
        f"   ({result['sft_steps']} steps)",
    ]
    if result["rl_reward_first"] is not None:
        lines.append(f"  RL          mean sampled reward     {result['rl_reward_first']:.3f} -> "
                     f"{result['rl_reward_last']:.3f}   ({result['rl_steps']} steps)")
    lines += [
        f"  held-out    reward                  {result['eval_reward_after_sft']:.3f} after SFT -> "
        f"{result['eval_reward_after_rl']:.3f} after RL",
        f"  held-out    accuracy                {result['eval_accuracy_after_sft']:.0%} after SFT -> "
        f"{result['eval_accuracy_after_rl']:.0%} after RL",
        f"  weights     {weights}",
        "",
        "Next steps:",
        f"  load the weights:   transformers.AutoModelForCausalLM.from_pretrained({weights!r})",
        f"  serve them:         skyrl-sdk serve --model {weights}",
        "  write your RL loop: docs/rl.md (a GRPO loop that runs as is) and examples/",
        "  the whole run as JSON (loss and reward curves): skyrl-sdk demo --json",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    steps, rl_steps, batch = args.steps, args.rl_steps, 32
    if args.short:
        steps, rl_steps, batch = min(steps, 12), min(rl_steps, 2), 8
    if not args.json:
        print(intro(steps, rl_steps), flush=True)
    threads = apply_threads(args.threads)
    if not args.json:
        print(f"  torch: {threads}", flush=True)
    result = run_demo(steps=steps, rl_steps=rl_steps, out_dir=args.out, seed=args.seed or 0,
                      batch_size=batch, quiet=args.json)
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(summary(result))
    return 0
