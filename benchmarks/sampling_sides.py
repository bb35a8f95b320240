"""The two sides of the sampling benchmark: our sampler (``Backend.sample``) and a plain
``model.generate()`` of the same batch, both drawing every row to exactly ``new_tokens``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PAD_ID = 258  # benchmarks.common.llama_config


def make_prompts(num_prompts: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(num_prompts)]


class SdkSampler:
    """``Backend.sample`` with ``stop=[]`` (no EOS stop: every row runs to max_tokens)."""

    def __init__(self, model_dir: str | Path, engine_config: dict | None = None) -> None:
        import skyrl_sdk

        self.backend = skyrl_sdk.Backend(model=str(model_dir), engine_config=engine_config or {})

    def sample(self, prompts, num_samples: int, new_tokens: int, seed: int = 1) -> int:
        from skyrl_sdk import types

        params = types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=seed)
        out = self.backend.sample(prompts, params, num_samples=num_samples)
        return sum(len(s.tokens) for o in out for s in o.sequences)


class PlainGenerate:
    """What a user writes: ``generate(do_sample=True, num_return_sequences=n)``, no logits kept."""

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        cfg = self.model.generation_config
        cfg.eos_token_id = None  # the same work as stop=[]: every row runs to max_new_tokens
        cfg.pad_token_id = PAD_ID
        cfg.top_k, cfg.top_p, cfg.temperature, cfg.do_sample = 0, 1.0, 1.0, True

    def sample(self, prompts, num_samples: int, new_tokens: int, seed: int = 1) -> int:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      num_return_sequences=num_samples)
        return int((out.shape[1] - ids.shape[1]) * out.shape[0])
