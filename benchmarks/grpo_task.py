"""The GRPO benchmark's shared setup: one model, one task, one set of hyper-parameters.

Every side (TRL's ``GRPOTrainer``, our ``Backend`` loop, the server through the tinker
client) reads its model directory, prompts, reward and settings from here, so they cannot
drift apart.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import attrs

from .common import make_model_dir, num_parameters

#: A 10.6M-parameter Llama over the tiny byte-level tokenizer's 320-token vocabulary.
GRPO_MODEL = dict(vocab=320, hidden=384, intermediate=1152, layers=6, heads=6, kv_heads=2, tie=False)
#: Smoke mode: the same code paths at toy sizes.
GRPO_MODEL_SMOKE = dict(vocab=320, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tie=False)

BOS_TEXT = "<|bos|>"  # the tiny tokenizer adds no BOS by itself; TRL tokenizes prompt text as is


@attrs.frozen
class GrpoSettings:
    """What all three sides share (the Tinker API trains LoRA only, so every side trains LoRA;
    attention + MLP, not lm_head, which TRL cannot adapt)."""

    steps: int
    groups: int  #: prompts per step
    group_size: int  #: samples per prompt (TRL's num_generations)
    max_tokens: int  #: completion length limit (TRL's max_completion_length)
    learning_rate: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    temperature: float = 1.0
    seed: int = 0
    #: characters (= tokens: byte-level tokenizer) of an instruction + few-shot preamble that
    #: every prompt starts with (benchmarks.grpo_prefix); 0: none
    preamble: int = 0

    def adam_kwargs(self) -> dict[str, float]:
        return dict(learning_rate=self.learning_rate, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                    weight_decay=0.0, grad_clip_norm=self.grad_clip_norm)


def settings(smoke: bool, steps: int | None = None, max_tokens: int | None = None) -> GrpoSettings:
    if smoke:
        return GrpoSettings(steps=steps or 2, groups=2, group_size=4, max_tokens=max_tokens or 4)
    return GrpoSettings(steps=steps or 30, groups=4, group_size=8, max_tokens=max_tokens or 6)


def model_dir(workdir: Path, smoke: bool) -> Path:
    spec = GRPO_MODEL_SMOKE if smoke else GRPO_MODEL
    return make_model_dir(Path(workdir) / ("grpo_model_smoke" if smoke else "grpo_model"), spec, seed=0)


def model_info(smoke: bool) -> dict[str, Any]:
    spec = GRPO_MODEL_SMOKE if smoke else GRPO_MODEL
    return {**spec, "parameters": num_parameters(spec)}


def prompt_texts(s: GrpoSettings) -> list[str]:
    """``groups`` prompts per step, fixed-width (``"042?"``) so no side pads a prompt; each
    after the same :func:`preamble_text` when ``s.preamble`` is set."""
    rng = random.Random(s.seed)
    head = preamble_text(s.preamble, s.seed)
    return [f"{head}{rng.randint(0, 999):03d}?" for _ in range(s.steps * s.groups)]


def preamble_text(length: int, seed: int = 0) -> str:
    """An instruction and few-shot examples, exactly ``length`` characters (a long system
    prompt: the part of every prompt that a group shares with the other groups, too)."""
    if length <= 0:
        return ""
    rng = random.Random(seed + 1)
    text = "Answer with exactly four digits, then stop.\n"
    while len(text) < length:
        text += f"{rng.randint(0, 999):03d}? {rng.randint(0, 9999):04d}\n"
    return text[:length]


def prompt_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


def reward(text: str) -> float:
    """An earlier docs/rl.md task: answer with exactly four digits (1.0), less for anything
    else (kept so the benchmark's numbers stay comparable across runs)."""
    return sum(c.isdigit() for c in text[:4]) / 4 - 0.25 * abs(len(text) - 4)


def lora_targets(directory: Path) -> list[str]:
    """The Linear modules our LoRA wraps (attention and MLP): TRL's peft config gets the same.

    No lm_head: TRL computes logprobs from ``lm_head.weight`` directly and refuses an adapter there.
    """
    from transformers import AutoModelForCausalLM

    from skyrl_sdk import types
    from skyrl_sdk.models.loading import lora_targets

    model = AutoModelForCausalLM.from_pretrained(str(directory))
    return lora_targets(model, types.LoraConfig(rank=1, train_unembed=False))
