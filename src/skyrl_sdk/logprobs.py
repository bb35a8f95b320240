"""Target log-probabilities (and entropy) from hidden states, memory-lean for long inputs.

Scoring T tokens against a V-word vocabulary materialises (T x V) float32 logits. When that
exceeds ``chunk_elements`` the lm_head and log-softmax run chunk by chunk under activation
checkpointing, so only one chunk's logits live at a time (the lm_head is recomputed in
backward: a little compute for a lot of memory).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Logit elements (tokens x vocab) above which scoring is chunked. 2**27 fp32 = 512 MiB.
DEFAULT_CHUNK_ELEMENTS = 2**27


def _score(logits: torch.Tensor, targets: torch.Tensor, want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if targets.dim() == 1:
        lp = -F.cross_entropy(logits, targets, reduction="none")
    else:  # top-K targets (T, K)
        lp = (logits - torch.logsumexp(logits, dim=-1, keepdim=True)).gather(1, targets)
    if want_entropy:
        with torch.no_grad():
            logz = torch.logsumexp(logits, dim=-1)
            entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    else:
        entropy = logits.new_zeros(0)
    return lp, entropy


def target_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    vocab_size: int,
    *,
    want_entropy: bool = True,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lp[t] = log softmax(head(hidden[t]))[targets[t]]`` for (T, H) hidden states.

    Returns ``(lp, entropy)``; ``entropy`` is detached (a metric) or ``None``.
    """
    num_tokens = hidden.shape[0]
    chunk = max(1, chunk_elements // max(1, vocab_size))
    if num_tokens <= chunk:
        lp, ent = _score(head(hidden), targets, want_entropy)
        return lp, (ent if want_entropy else None)

    def run(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _score(head(h), t, want_entropy)

    lps, ents = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, num_tokens, chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        lp, ent = checkpoint(run, h, t, use_reentrant=False) if grad else run(h, t)
        lps.append(lp)
        ents.append(ent.detach())
    return torch.cat(lps), (torch.cat(ents) if want_entropy else None)
