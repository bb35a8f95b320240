"""Generation from the current weights: batched, KV-cached (transformers ``generate``).

Returned logprobs are those of the sampled tokens under the model's own distribution
(temperature 1, no top-k / top-p), i.e. what ``forward`` reports for the same tokens, so
they can be fed back as the ``logprobs`` input of RL losses.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from .types import SampledSequence, SampleOutput, SamplingParams

logger = logging.getLogger(__name__)


def _stop_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    ids = [s for s in params.stop if isinstance(s, int)]
    if eos_token_id is not None:
        ids.append(int(eos_token_id))
    return sorted(set(ids))


@torch.no_grad()
def prompt_logprobs_of(module, prompt: np.ndarray, device: torch.device) -> list[float | None]:
    """``[None, lp(x1|x0), lp(x2|x0,x1), ...]`` for one prompt."""
    ids = torch.from_numpy(prompt).to(device).unsqueeze(0)
    logits = module(input_ids=ids, use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
    return [None] + lp.cpu().tolist()


@torch.no_grad()
def generate(
    module,
    tokenizer,
    prompts: Sequence[np.ndarray],
    params: SamplingParams,
    num_samples: int = 1,
    *,
    device: torch.device,
    eos_token_id: int | None,
    pad_token_id: int,
    prompt_logprobs: bool = False,
) -> list[SampleOutput]:
    """Sample ``num_samples`` continuations of every prompt; one :class:`SampleOutput` per prompt."""
    rows = [p for p in prompts for _ in range(num_samples)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, p in enumerate(rows):  # left padding, as decoder-only generation expects
        ids[r, width - len(p):] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        mask[r, width - len(p):] = 1
    stop_ids = _stop_ids(params, eos_token_id)
    stop_strings = [s for s in params.stop if isinstance(s, str)]
    kwargs = dict(
        max_new_tokens=params.max_tokens,
        do_sample=params.temperature > 0,
        return_dict_in_generate=True,
        output_logits=True,
        use_cache=True,
        pad_token_id=pad_token_id,
        eos_token_id=stop_ids or None,
    )
    if params.temperature > 0:
        kwargs.update(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else None,
                      top_p=params.top_p)
    if stop_strings:
        kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
    cuda_ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_ids):
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = module.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
    new_tokens = out.sequences[:, width:].cpu()
    logits = torch.stack(out.logits, dim=1).float()  # (rows, steps, V), raw model logits
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, new_tokens.to(logits.device).unsqueeze(-1)).squeeze(-1).cpu()
    sequences = []
    for r in range(len(rows)):
        toks = new_tokens[r].tolist()
        lps = logprobs[r].tolist()
        end, reason = len(toks), "length"
        for i, t in enumerate(toks):
            if t in stop_ids:
                end, reason = i + 1, "stop"
                break
        if stop_strings and reason == "length" and tokenizer is not None:
            end, reason = _cut_at_stop_string(tokenizer, toks[:end], stop_strings, end, reason)
        sequences.append(SampledSequence(tokens=toks[:end], logprobs=lps[:end], stop_reason=reason))
    results = []
    for i, prompt in enumerate(prompts):
        plp = prompt_logprobs_of(module, np.asarray(prompt, dtype=np.int64), device) if prompt_logprobs else None
        results.append(SampleOutput(sequences=sequences[i * num_samples:(i + 1) * num_samples], prompt_logprobs=plp))
    return results


def _cut_at_stop_string(tokenizer, toks: list[int], stop_strings: list[str], end: int, reason: str):
    """Cut after the first token whose decoded prefix contains a stop string."""
    for i in range(1, len(toks) + 1):
        text = tokenizer.decode(toks[:i])
        if any(s in text for s in stop_strings):
            return i, "stop"
    return end, reason
