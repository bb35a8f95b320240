"""Group a call's datums into micro-batches by a token budget.

Two layouts, both exact (a datum is never split, so SUM losses add up):

- ``bucket`` (default): sort by length and cut the sorted list into right-padded groups
  with ``rows * longest <= micro_batch_tokens``, choosing the cuts that minimise padded
  tokens plus a small per-micro-batch overhead (exact dynamic programme); an attention
  mask hides the padding. Padding is what makes a hand-written loop slow on varied
  lengths: this cuts it to a few percent while keeping micro-batches large.
  Rows are right-padded, so with a causal model the real tokens never attend to the
  padding (``ScoringModel`` then drops the mask and attention runs its causal path).
- ``pack``: concatenate datums into one row per micro-batch with ``position_ids``
  restarting per datum (needs ``use_cache=False``; on CUDA with flash attention this is
  the padding-free varlen path).

With ``prefix_min_tokens`` (prefix sharing on), datums that share a head of at least that
many tokens (the samples of an RL group) are first taken out into shared-prefix rows
(:mod:`skyrl_sdk.models.prefix`), several groups per micro-batch within the budget of
*unique* tokens and within 15/16 of the largest micro-batch the unshared layout would make of
the same datums; of the prefix keys and values their attention expands over the suffix rows,
a row keeps for backward only what fits the tokens it leaves unused of that micro-batch (the
rest is recomputed in backward: ``layout_groups(expand=...)``), so sharing never raises the
peak memory. The rest goes through the layout above.

For a vision-language model (``vision_language``) every micro-batch carries M-RoPE positions,
computed per datum (:func:`~skyrl_sdk.models.vlm.mrope_positions`), and its images' pixels in
the order of their positions; prefix sharing is then off (engines/sharing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np
import torch

from ..models.prefix import ExpansionBudget, Group, PrefixPlan, fill_rows, find_groups, layout_groups
from ..models.vlm import image_tensors, mrope_positions
from ..types import Datum

Layout = Literal["bucket", "pack"]


@attrs.frozen(eq=False)
class MicroBatch:
    """Model inputs for a group of datums plus how to find their tokens in the output.

    ``flat_index`` (T,) indexes the flattened (rows * length) model output and lists the
    real tokens datum after datum in ``datum_indices`` order; ``segment_ids`` (T,) gives the
    local datum number of each; ``offsets`` (len+1,) the start of each datum in T.
    """

    datum_indices: tuple[int, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    flat_index: torch.Tensor
    segment_ids: torch.Tensor
    offsets: np.ndarray
    #: a shared-prefix row's plan for the attention (``input_ids`` is then one row of unique
    #: tokens and ``flat_index`` repeats the prefix slots of every datum); None otherwise
    prefix: PrefixPlan | None = None
    #: the images' ``(pixel_values, image_grid_thw)``, in the order of their positions; None: no image
    images: tuple[torch.Tensor, torch.Tensor] | None = None


#: Cost of one more micro-batch, in padded tokens, when ``bucket`` chooses its cuts: the
#: fixed per-forward/backward cost (Python, kernel launches) measured on CPU is about this.
MICRO_BATCH_OVERHEAD_TOKENS = 64
#: A shared-prefix row holds at most this fraction of the tokens of the largest micro-batch the
#: unshared layout makes of the same datums: per token it keeps a little more for backward
#: (the head's hidden states of each distinct (slot, target) pair, rotary tables per slot;
#: 2-3% on ``tiny``), and within this its peak memory never exceeds the unshared path's
#: (tests/test_prefix_sharing.py, benchmarks/prefix_memory.py).
SHARED_ROW_FRACTION = 15 / 16
#: Expanded prefix slots (keys and values of one position, per query head) a shared row may keep
#: in place of one token it leaves unused of the unshared micro-batch. Per layer a slot keeps
#: 2 x hidden floats; a token keeps its two norms' inputs and outputs, queries, attention output
#: (6 x hidden), keys and values, and 4 x intermediate of its MLP: at least 8 x hidden for any
#: MLP wider than half the hidden size (2560 floats against a slot's 256 on ``tiny``), so four
#: slots cost at most a token.
KEPT_SLOTS_PER_TOKEN = 4
#: A shared row's per-token outputs (logprobs, losses, their gradients) cover every member's
#: tokens, its prefix repeated: a few hundred bytes per position, against ~20 KB a token keeps on
#: ``tiny`` (more on any larger model). So a row holds at most this many positions per token of
#: the unshared layout's largest micro-batch.
REPEATED_TOKENS_PER_TOKEN = 32
#: Above this many (datum, cut) candidates the exact cut search falls back to greedy filling.
_MAX_DP_WORK = 20_000_000


def _group_greedy(order: np.ndarray, lengths: np.ndarray, budget: int, layout: Layout) -> list[list[int]]:
    """Fill micro-batches in length order while the budget allows (padded tokens for buckets)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    used = 0
    for idx in order.tolist():
        n = int(lengths[idx])
        if layout == "bucket":
            cost = max(longest, n) * (len(current) + 1)
        else:
            cost = used + n
        if current and cost > budget:
            groups.append(current)
            current, longest, used = [], 0, 0
        current.append(idx)
        longest = max(longest, n)
        used += n
    if current:
        groups.append(current)
    return groups


def _group_buckets(order: np.ndarray, lengths: np.ndarray, budget: int) -> list[list[int]] | None:
    """Optimal cuts of the length-sorted (longest first) datums into padded buckets.

    ``best[j]`` is the least cost of the first ``j`` datums; a bucket ``[i, j)`` costs
    ``L[i] * (j - i)`` padded tokens (``L[i]`` is its longest) plus the overhead, and may
    not exceed the budget unless it holds a single datum. Returns None when the search
    would be too long (then the caller fills greedily).
    """
    sorted_len = lengths[order]
    n = len(sorted_len)
    # the widest bucket that can end at j starts no earlier than j - budget // L[j-1]
    widths = np.minimum(np.arange(1, n + 1), np.maximum(1, budget // np.maximum(sorted_len, 1)))
    if int(widths.sum()) > _MAX_DP_WORK:
        return None
    best = np.zeros(n + 1, dtype=np.float64)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        lo = j - int(widths[j - 1])
        i = np.arange(lo, j)
        cost = sorted_len[lo:j] * (j - i)
        total = best[lo:j] + cost + MICRO_BATCH_OVERHEAD_TOKENS
        total[cost > budget] = np.inf
        total[-1] = best[j - 1] + sorted_len[j - 1] + MICRO_BATCH_OVERHEAD_TOKENS  # one datum always fits
        k = int(np.argmin(total))
        best[j] = total[k]
        start[j] = lo + k
    groups = []
    j = n
    while j > 0:
        first = int(start[j])
        groups.append(order[first:j].tolist())
        j = first
    return groups[::-1]


def _group(lengths: np.ndarray, budget: int, layout: Layout) -> list[list[int]]:
    """Length-sorted grouping under the token budget (padded tokens for buckets)."""
    order = np.argsort(-lengths, kind="stable")
    if layout == "bucket" and len(lengths) > 1:
        groups = _group_buckets(order, lengths, budget)
        if groups is not None:
            return groups
    return _group_greedy(order, lengths, budget, layout)


def make_micro_batches(
    data: Sequence[Datum], micro_batch_tokens: int, layout: Layout = "bucket", pad_id: int = 0,
    prefix_min_tokens: int | None = None, vision_language: bool = False,
) -> list[MicroBatch]:
    if layout not in ("bucket", "pack"):
        raise ValueError(f"engine_config['batching'] must be 'bucket' or 'pack', got {layout!r}")
    tokens = [d.model_input.to_numpy() for d in data]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    budget = max(1, int(micro_batch_tokens))
    batches: list[MicroBatch] = []
    rest = np.arange(len(data))
    if prefix_min_tokens is not None and len(data) > 1:
        # a shared row holds fewer tokens than the unshared layout's largest micro-batch of these
        # datums: its peak memory stays within the unshared path's (SHARED_ROW_FRACTION)
        largest = _largest_micro_batch(lengths, budget, layout)
        row_budget = min(budget, int(SHARED_ROW_FRACTION * largest))
        max_total = REPEATED_TOKENS_PER_TOKEN * largest
        groups, alone = find_groups(tokens, prefix_min_tokens, row_budget, max_total)
        batches += [_shared_batch(tokens, lengths, part, largest)
                    for part in fill_rows(groups, row_budget, max_total)]
        rest = np.asarray(alone, dtype=np.int64)
    position_ids: torch.Tensor | None
    for local in _group(lengths[rest], budget, layout) if len(rest) else []:
        group = rest[local].tolist()
        seqs = [tokens[i] for i in group]
        lens = lengths[group]
        offsets = np.concatenate([[0], np.cumsum(lens)])
        segment_ids = torch.from_numpy(np.repeat(np.arange(len(group)), lens))
        images = image_tensors([data[i].model_input for i in group]) if vision_language else None
        if layout == "pack":
            input_ids = torch.from_numpy(np.concatenate(seqs)).unsqueeze(0)
            position_ids = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).unsqueeze(0)
            if vision_language:  # (4, 1, L): the text positions first, then M-RoPE's three rows
                mrope = np.concatenate([mrope_positions(data[i].model_input) for i in group], axis=1)
                position_ids = torch.cat([position_ids.unsqueeze(0), torch.from_numpy(mrope).unsqueeze(1)])
            flat_index = torch.arange(int(offsets[-1]))
            batches.append(MicroBatch(tuple(group), input_ids, None, position_ids, flat_index, segment_ids, offsets,
                                      images=images))
            continue
        width = int(lens.max())
        ids = np.full((len(group), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(group), width), dtype=np.int64)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        flat_index = torch.from_numpy(np.flatnonzero(mask.reshape(-1)))
        attention_mask = None if mask.all() else torch.from_numpy(mask)
        position_ids = None
        if vision_language:  # (3, rows, width), padding at position 0
            positions = np.zeros((3, len(group), width), dtype=np.int64)
            for row, i in enumerate(group):
                positions[:, row, : lens[row]] = mrope_positions(data[i].model_input)
            position_ids = torch.from_numpy(positions)
        batches.append(MicroBatch(tuple(group), torch.from_numpy(ids), attention_mask, position_ids, flat_index,
                                  segment_ids, offsets, images=images))
    return batches


def _largest_micro_batch(lengths: np.ndarray, budget: int, layout: Layout) -> int:
    """Tokens (padded, for buckets) of the largest micro-batch the unshared layout makes of ``lengths``."""
    groups = _group(lengths, budget, layout)
    if layout == "pack":
        return max(int(lengths[g].sum()) for g in groups)
    return max(int(lengths[g].max()) * len(g) for g in groups)


def _shared_batch(tokens: Sequence[np.ndarray], lengths: np.ndarray, groups: Sequence[Group],
                  largest: int) -> MicroBatch:
    """One shared row of ``groups``; ``largest``: tokens of the unshared layout's largest
    micro-batch of the call. What the row's attention keeps of its expanded prefixes fits the
    tokens the row leaves unused of that (:data:`KEPT_SLOTS_PER_TOKEN` per token); each call
    holds at most ``largest`` slots."""
    unique = sum(g.unique_tokens for g in groups)
    keep = KEPT_SLOTS_PER_TOKEN * max(0, largest - unique)
    row = layout_groups(tokens, groups, ExpansionBudget(keep=keep, chunk=largest))
    members = tuple(m for g in groups for m in g.members)
    lens = lengths[list(members)]
    flat_index = torch.from_numpy(np.concatenate([row.paths[m] for m in members]))
    segment_ids = torch.from_numpy(np.repeat(np.arange(len(members)), lens))
    offsets = np.concatenate([[0], np.cumsum(lens)])
    return MicroBatch(members, row.input_ids, None, row.position_ids, flat_index, segment_ids, offsets, row.plan)


def pack_inputs(data: Sequence[Datum], group: Sequence[int]) -> dict[str, np.ndarray]:
    """Concatenate each loss_fn_inputs key over the datums of a micro-batch."""
    keys = data[group[0]].loss_fn_inputs.keys()
    return {k: np.concatenate([data[i].loss_fn_inputs[k].array for i in group]) for k in keys}
