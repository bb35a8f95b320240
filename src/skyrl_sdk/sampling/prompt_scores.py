"""Prompt logprobs and top-k prompt logprobs, from the prefill's hidden states.

Scored with the very function ``forward`` uses (:func:`skyrl_sdk.logprobs.target_logprobs`),
chunk by chunk, so no (prompt tokens x vocab) buffer beyond one chunk is ever alive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..logprobs import CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS, target_logprobs


def prompt_logprobs(
    hidden: torch.Tensor, head: Callable, prompt: torch.Tensor, vocab_size: int
) -> list[float | None]:
    """``[None, lp(x1|x0), lp(x2|x0,x1), ...]`` from the (n, H) hidden states of one prompt."""
    if prompt.shape[0] < 2:
        return [None]
    lp, _ = target_logprobs(hidden[:-1], head, prompt[1:], vocab_size, want_entropy=False,
                            chunk_elements=DEFAULT_CHUNK_ELEMENTS)
    return [None] + lp.float().cpu().tolist()


def topk_prompt_logprobs(
    hidden: torch.Tensor, head: Callable, k: int, vocab_size: int
) -> list[list[tuple[int, float]] | None]:
    """Per prompt position, the ``k`` most likely ``(token_id, logprob)`` (None at position 0)."""
    k = min(k, vocab_size)
    out: list[list[tuple[int, float]] | None] = [None]
    chunk = max(1, CHUNK_ELEMENTS // max(1, vocab_size))
    for start in range(0, hidden.shape[0] - 1, chunk):
        logits = head(hidden[start:min(start + chunk, hidden.shape[0] - 1)]).float()
        values, ids = torch.topk(logits, k, dim=-1)
        values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
        del logits
        for row_ids, row_lps in zip(ids.cpu().tolist(), values.cpu().tolist(), strict=True):
            out.append(list(zip(row_ids, row_lps, strict=True)))
    return out
