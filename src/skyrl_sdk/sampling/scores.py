"""Logprobs the sampler reports besides its draws, scored the way ``forward`` scores.

- **Prompt logprobs** and top-k prompt logprobs, from the prefill's hidden states, with the
  function ``forward`` uses (:func:`~skyrl_sdk.models.logprobs.target_logprobs`), chunk by
  chunk, so no (prompt tokens x vocab) buffer beyond one chunk is ever alive.
- **Rescoring** for low-precision weights. In float32 the decode loop's logprobs agree with
  ``forward`` to ~1e-6. In bfloat16 the one-query attention over the KV cache rounds
  differently from a full causal pass (~4e-3 apart), so the sequences are scored once more
  without a cache, right-padded, in micro-batches of at most :data:`RESCORE_TOKENS` tokens:
  the computation ``forward`` runs. With prefix sharing, the rows a ``forward`` of these
  samples would share are scored in the same shared-prefix rows (sharing moves bf16 results
  by about 1e-3, as any change of kernel shapes does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..models.logprobs import CHUNK_SIZE_ELEMENTS, CHUNK_THRESHOLD_ELEMENTS, target_logprobs
from ..models.prefix import ExpansionBudget, fill_rows, find_groups, layout_groups
from ..models.prefix_attention import enabled, shared_hidden
from ..models.vlm import as_model_input, padded_rows_inputs
from ..types import EncodedTextChunk, ModelInput

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Padded tokens per rescoring micro-batch (bounds activations, like ``micro_batch_tokens``).
RESCORE_TOKENS = 8192


def needs_rescoring(module: torch.nn.Module) -> bool:
    """True when some floating-point weight is below float32 precision, or when the decode
    loop runs under autocast to a narrower compute dtype (mixed precision)."""
    if any(p.is_floating_point() and p.dtype != torch.float32 and p.dtype != torch.float64
           for p in module.parameters()):
        return True
    device = next((p.device.type for p in module.parameters()), "cpu")
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in (torch.bfloat16, torch.float16)


def rescore(
    backbone: PreTrainedModel, head: Callable, vocab_size: int, prompts: Sequence[np.ndarray | ModelInput],
    num_samples: int, tokens: list[list[int]], lengths: list[int], pad_token_id: int, device: torch.device,
    prefix_min_tokens: int | None = None, vision_language: bool = False,
) -> list[list[float]]:
    """Logprobs of ``tokens[r][:lengths[r]]`` after their prompt, for every row ``r`` (a
    vision-language model's rows with their prompt's images and M-RoPE positions)."""
    generated = [np.asarray(tokens[r][:lengths[r]], dtype=np.int64) for r in range(len(tokens))]
    full = [as_model_input(prompts[r // num_samples]).append(EncodedTextChunk(generated[r]))
            for r in range(len(tokens))] if vision_language else None
    rows = [np.concatenate([np.asarray(as_model_input(prompts[r // num_samples]).to_numpy(), dtype=np.int64),
                            generated[r]]) for r in range(len(tokens))]
    out: list[list[float]] = [[] for _ in rows]
    alone: Sequence[int] = range(len(rows))
    if prefix_min_tokens is not None and enabled(backbone):
        alone = _rescore_shared(backbone, head, vocab_size, rows, lengths, prefix_min_tokens, device, out)
    order = sorted(alone, key=lambda r: len(rows[r]))
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and len(rows[order[end]]) * (end + 1 - start) <= RESCORE_TOKENS:
            end += 1
        batch = order[start:end]
        width = len(rows[batch[-1]])
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, :len(rows[r])] = torch.from_numpy(rows[r])
        vision = {} if full is None else padded_rows_inputs([full[r] for r in batch], width, left_padded=False)
        hidden = backbone(input_ids=ids.to(device), use_cache=False,
                          **{k: v.to(device) for k, v in vision.items()}).last_hidden_state
        for i, r in enumerate(batch):
            n_prompt, n_gen = len(rows[r]) - lengths[r], lengths[r]
            if n_gen == 0:
                continue
            h = hidden[i, n_prompt - 1:n_prompt - 1 + n_gen]
            targets = ids[i, n_prompt:n_prompt + n_gen].to(device)
            lp, _ = target_logprobs(h, head, targets, vocab_size, want_entropy=False,
                                    chunk_elements=CHUNK_THRESHOLD_ELEMENTS)
            out[r] = lp.float().cpu().tolist()
        del hidden
        start = end
    return out


def _rescore_shared(backbone: PreTrainedModel, head: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    rows: list[np.ndarray], lengths: list[int], min_tokens: int, device: torch.device,
                    out: list[list[float]]) -> list[int]:
    """Score the rows ``forward`` would share in its shared-prefix rows (``forward``'s datums
    are the rows without their last token); returns the rows left to the padded path."""
    datums = {r: rows[r][:-1] for r in range(len(rows)) if lengths[r] > 0}
    keys = list(datums)
    groups, alone = find_groups([datums[r] for r in keys], min_tokens, RESCORE_TOKENS)
    for part in fill_rows(groups, RESCORE_TOKENS):
        # no gradients: nothing is kept, and each attention call expands at most RESCORE_TOKENS slots
        row = layout_groups([datums[r] for r in keys], part, ExpansionBudget(keep=0, chunk=RESCORE_TOKENS))
        hidden = shared_hidden(backbone, row.input_ids.to(device), row.position_ids.to(device), row.plan.to(device))
        members = [m for g in part for m in g.members]
        counts = [lengths[keys[m]] for m in members]  # each row's sampled tokens: the last slots of its path
        slots = np.concatenate([row.paths[m][-n:] for m, n in zip(members, counts, strict=True)])
        targets = np.concatenate([rows[keys[m]][-n:] for m, n in zip(members, counts, strict=True)])
        lp, _ = target_logprobs(hidden.index_select(0, torch.from_numpy(slots).to(device)), head,
                                torch.from_numpy(targets).to(device), vocab_size, want_entropy=False,
                                chunk_elements=CHUNK_THRESHOLD_ELEMENTS)  # one head call per shared row
        for m, values in zip(members, np.split(lp.float().cpu().numpy(), np.cumsum(counts)[:-1]), strict=True):
            out[keys[m]] = values.tolist()
        del hidden
    return [keys[m] for m in alone]


def prompt_logprobs(
    hidden: torch.Tensor, head: Callable, prompt: torch.Tensor, vocab_size: int
) -> list[float | None]:
    """``[None, lp(x1|x0), lp(x2|x0,x1), ...]`` from the (n, H) hidden states of one prompt."""
    if prompt.shape[0] < 2:
        return [None]
    lp, _ = target_logprobs(hidden[:-1], head, prompt[1:], vocab_size, want_entropy=False,
                            chunk_elements=CHUNK_THRESHOLD_ELEMENTS)
    return [None] + lp.float().cpu().tolist()


def topk_prompt_logprobs(
    hidden: torch.Tensor, head: Callable, k: int, vocab_size: int
) -> list[list[tuple[int, float]] | None]:
    """Per prompt position, the ``k`` most likely ``(token_id, logprob)`` (None at position 0)."""
    k = min(k, vocab_size)
    out: list[list[tuple[int, float]] | None] = [None]
    chunk = max(1, CHUNK_SIZE_ELEMENTS // max(1, vocab_size))
    for start in range(0, hidden.shape[0] - 1, chunk):
        logits = head(hidden[start:min(start + chunk, hidden.shape[0] - 1)]).float()
        values, ids = torch.topk(logits, k, dim=-1)
        values = values - torch.logsumexp(logits, dim=-1, keepdim=True)
        del logits
        for row_ids, row_lps in zip(ids.cpu().tolist(), values.cpu().tolist(), strict=True):
            out.append(list(zip(row_ids, row_lps, strict=True)))
    return out


def _position_chunks(n: int, vocab_size: int) -> Iterator[range]:
    """Ranges of prompt positions whose (positions x vocab) logits fit one chunk."""
    chunk = max(1, CHUNK_SIZE_ELEMENTS // max(1, vocab_size))
    return (range(start, min(start + chunk, n)) for start in range(0, n, chunk))


def target_prompt_logprobs(hidden: torch.Tensor, head: Callable, ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[len(prompt) - 1, K]`` float32: the logprob at position ``i + 1`` of token ``ids[i, j]``
    (0.0 where ``ids`` is -1). Rows before the first one that names a token are not computed."""
    out = np.zeros(ids.shape, dtype=np.float32)
    named = np.flatnonzero((ids >= 0).any(axis=1))
    if named.size == 0:
        return out
    first = int(named[0])
    wanted = torch.from_numpy(np.clip(ids, 0, None)).to(hidden.device)
    for rows in _position_chunks(ids.shape[0] - first, vocab_size):
        r0, r1 = first + rows.start, first + rows.stop
        logits = head(hidden[r0:r1]).float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, wanted[r0:r1])
        out[r0:r1] = lp.cpu().numpy()
        del logits
    out[ids < 0] = 0.0
    return out


def prompt_alt_tokens(hidden: torch.Tensor, head: Callable, k: int, temperature: float,
                      generator: torch.Generator, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``k`` independent draws (with replacement) at every prompt position after the first from
    ``softmax(logits / temperature)`` (temperature 0: the most likely token), and their model
    logprobs (temperature 1): two ``[len(prompt) - 1, k]`` arrays."""
    n = hidden.shape[0] - 1
    tokens = np.zeros((n, k), dtype=np.int64)
    logprobs = np.zeros((n, k), dtype=np.float32)
    for rows in _position_chunks(n, vocab_size):
        logits = head(hidden[rows.start:rows.stop]).float()
        logp = torch.log_softmax(logits, dim=-1)
        greedy = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
        if temperature == 0.0:
            drawn = greedy
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            finite = torch.isfinite(probs).all(dim=-1, keepdim=True)  # a tiny temperature: greedy in the limit
            drawn = torch.multinomial(torch.where(finite, probs, 1.0), k, replacement=True, generator=generator)
            drawn = torch.where(finite, drawn, greedy)
        tokens[rows.start:rows.stop] = drawn.cpu().numpy()
        logprobs[rows.start:rows.stop] = logp.gather(1, drawn).cpu().numpy()
        del logits, logp
    return tokens, logprobs
