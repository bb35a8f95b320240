"""Use the installed ``clipped_pg`` plugin: check it against a hand-written formula, then
train the tiny model with it for a few steps.

    pip install -e examples/loss_plugin
    python examples/loss_plugin/use_it.py [--steps 20]
"""

from __future__ import annotations

import argparse

import torch

import skyrl_sdk
from skyrl_sdk import evaluate_loss, types
from skyrl_sdk.rl import datum_from_sample, group_advantages


def check_formula() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.1], requires_grad=True)
    adv = torch.tensor([0.0, 3.0, -0.5, -4.0])
    loss, m = evaluate_loss("clipped_pg", lp, {"advantages": adv}, {"max_abs_advantage": 2.0})
    loss.backward()
    expected = -(adv.clamp(-2.0, 2.0) * lp.detach()).sum()
    assert torch.allclose(loss, expected) and torch.allclose(lp.grad, -adv.clamp(-2.0, 2.0))
    # the :mean metrics average over the three scored tokens (advantage != 0), not all four
    assert abs(m["logprob:mean"] - (-2.0 - 0.5 - 0.1) / 3) < 1e-6 and abs(m["advantage_clipped:mean"] - 2 / 3) < 1e-6
    print(f"formula ok: loss {loss.item():.3f}, metrics {m}")


def train(steps: int) -> None:
    with skyrl_sdk.Backend(model="tiny", seed=0) as backend:
        tok = backend.tokenizer
        # seed=0: the same draws on every run (a random model rarely writes digits; unseeded, a step
        # whose groups all tie has no datum to train on)
        sampling = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[tok.eos_token_id], seed=0)
        for step in range(steps):
            prompts = [[tok.bos_token_id, *tok.encode(f"{i}{step}?", add_special_tokens=False)] for i in range(4)]
            data, rewards = [], []
            for prompt, out in zip(prompts, backend.sample(prompts, sampling, num_samples=8), strict=True):
                group = [sum(c.isdigit() for c in tok.decode(s.tokens, skip_special_tokens=True)) / 4
                         for s in out.sequences]
                rewards += group
                advantages = group_advantages(group)
                data += [datum_from_sample(prompt, s, a) for s, a in zip(out.sequences, advantages, strict=True)
                         if a != 0 and s.tokens]
            if data:
                out = backend.forward_backward(data, "clipped_pg", {"max_abs_advantage": 1.5})
                backend.optim_step(types.AdamParams(learning_rate=3e-3))
                print(f"step {step}: reward {sum(rewards) / len(rewards):.3f}  "
                      f"logprob:mean {out.metrics['logprob:mean']:.3f}  "
                      f"advantage_clipped:mean {out.metrics['advantage_clipped:mean']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    check_formula()
    train(args.steps)
