"""PPO with a critic, in the style of SkyRL's trainer, on the built-in tiny model (offline).

Three Backends: the policy (trained), a critic (``role="critic"``, trained with its default
loss ``value``) and a frozen reference policy for the KL term. Each step:

1. sample completions of digit prompts from the policy (the reward: the fraction of
   completion characters that are digits, given on the last token);
2. score them with the frozen reference (``ref_logprobs``) and the critic (values ``V``);
3. GAE advantages over the completion tokens from the rewards and ``V``;
4. one policy update: Tinker ``ppo`` with ``loss_reduction="token_mean"`` and a k3 KL term to
   the reference (``kl_coef``); one critic update towards the GAE returns.

Run ``python examples/ppo_critic.py`` (``--smoke`` for a few seconds' check, as the tests do).
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np

from skyrl_sdk import Backend, types

POLICY_ADAM = types.AdamParams(learning_rate=5e-4, beta1=0.9, beta2=0.98, grad_clip_norm=1.0)
CRITIC_ADAM = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.98, grad_clip_norm=1.0)
POLICY_CONFIG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2,
                 "loss_reduction": "token_mean", "kl_coef": 0.05, "kl_estimator": "k3"}
CRITIC_CONFIG = {"value_clip": 0.2, "loss_reduction": "token_mean"}


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over one completion: (advantages, returns = A + V)."""
    adv = np.zeros_like(values)
    running = 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, adv + values


def digit_reward(tokenizer, completion: list[int]) -> float:
    text = tokenizer.decode([t for t in completion if t != tokenizer.eos_token_id])
    return sum(c.isdigit() for c in text) / max(1, len(text))


def rollouts(policy: Backend, rng: random.Random, prompts_per_step: int, samples: int, max_tokens: int, seed: int):
    """[(prompt tokens, completion tokens, sampler logprobs, reward)] from the current policy."""
    tok = policy.tokenizer
    prompts = [[tok.bos_token_id] + tok.encode("".join(rng.choice("0123456789") for _ in range(3)) + ">",
                                               add_special_tokens=False)
               for _ in range(prompts_per_step)]
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    out = []
    for prompt, result in zip(prompts, policy.sample(prompts, params, num_samples=samples), strict=True):
        for seq in result.sequences:
            if seq.tokens:
                out.append((prompt, list(seq.tokens), list(seq.logprobs), digit_reward(tok, seq.tokens)))
    return out


def ppo_step(policy: Backend, critic: Backend, reference: Backend, batch, gamma: float, lam: float) -> dict:
    shaped = []  # (model_input, targets, first completion position, sampler logprobs, reward)
    for prompt, completion, logprobs, reward in batch:
        full = prompt + completion
        shaped.append((full[:-1], full[1:], len(prompt) - 1, logprobs, reward))

    def datum(tokens, inputs):
        return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)

    # the frozen reference's logprobs of the same tokens (forward changes no state)
    ref = reference.forward([datum(x, {"target_tokens": y}) for x, y, *_ in shaped], "cross_entropy")
    # the critic's values V (a critic's forward without values/returns reads them)
    values = critic.forward([datum(x, {}) for x, *_ in shaped])

    policy_data, critic_data = [], []
    for (x, y, start, logprobs, reward), r_out, v_out in zip(shaped, ref.loss_fn_outputs, values.loss_fn_outputs,
                                                             strict=True):
        n = len(x)
        v = v_out["values"].to_numpy().astype(np.float32)
        rewards = np.zeros(n - start, np.float32)
        rewards[-1] = reward  # the outcome reward on the last completion token
        adv, ret = gae(rewards, v[start:], gamma, lam)
        mask = np.zeros(n, np.float32)
        mask[start:] = 1.0
        full_adv, full_ret = np.zeros(n, np.float32), np.zeros(n, np.float32)
        full_adv[start:], full_ret[start:] = adv, ret
        sampler = np.zeros(n, np.float32)
        sampler[start:] = logprobs
        policy_data.append(datum(x, {"target_tokens": y, "logprobs": sampler, "advantages": full_adv,
                                     "weights": mask, "ref_logprobs": r_out["logprobs"].to_numpy()}))
        critic_data.append(datum(x, {"values": v, "returns": full_ret, "weights": mask}))

    pol = policy.forward_backward(policy_data, "ppo", POLICY_CONFIG)
    policy.optim_step(POLICY_ADAM)
    cri = critic.forward_backward(critic_data, loss_fn_config=CRITIC_CONFIG)  # default loss: value
    critic.optim_step(CRITIC_ADAM)
    return {
        "reward": float(np.mean([b[3] for b in batch])),
        "policy_loss": pol.metrics["pg_loss:sum"],
        "kl_loss": pol.metrics["kl_loss:sum"],
        "critic_loss": cri.metrics["vf_loss:sum"],
    }


def run(steps: int, prompts_per_step: int, samples: int, max_tokens: int, seed: int = 0,
        gamma: float = 1.0, lam: float = 0.95) -> list[dict]:
    rng = random.Random(seed)
    history = []
    with Backend(model="tiny", seed=seed) as policy, Backend(model="tiny", seed=seed) as reference, \
            Backend(model="tiny", role="critic", seed=seed) as critic:
        for step in range(steps):
            batch = rollouts(policy, rng, prompts_per_step, samples, max_tokens, seed=1000 + step)
            metrics = ppo_step(policy, critic, reference, batch, gamma, lam) if batch else {}
            history.append({"step": step, **metrics})
            print(json.dumps(history[-1]))
    return history


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps: checks the loop runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.prompts, args.samples, args.max_tokens = 2, 2, 2, 4
    return run(args.steps, args.prompts, args.samples, args.max_tokens, seed=args.seed)


if __name__ == "__main__":
    main()
