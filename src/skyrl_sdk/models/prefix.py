"""Shared-prefix layouts: datums that start alike are computed with their common start once.

In an RL batch the samples of a group share their prompt. :func:`find_groups` finds such
groups among any token lists (not only identical prompts: any common head, several groups,
singletons beside them) and :func:`layout_groups` lays groups out in one packed row::

    [prefix][suffix 1][suffix 2]...[suffix G] [prefix'][suffix' 1]...

Every token keeps the position it has in its own sequence (0..P-1 for the prefix, P.. again
for every suffix). The attention of :mod:`.prefix_attention` lets a suffix see its group's
prefix and itself, so each slot's hidden state is the one it has in its own sequence. A
datum's ``path`` lists its tokens' slots as if it had been laid out alone (the prefix slots,
then its suffix): per-token outputs, losses and gradients are those of the unshared
computation, autograd adding up the gradients of the repeated prefix slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

#: A group is shared only when that saves at least this fraction of its tokens: below it the
#: two-part attention's extra calls cost about what the shared tokens save (docs/performance.md).
MIN_SAVED_FRACTION = 0.10


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common head of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@attrs.frozen
class Group:
    """Datums (indices into the sequences) computed with their first ``prefix`` tokens once."""

    members: tuple[int, ...]
    prefix: int
    #: tokens the group's row holds: the prefix once, then every member's suffix
    unique_tokens: int
    #: the members' tokens, the prefix counted once per member (what per-token outputs hold)
    tokens: int = 0


def find_groups(seqs: Sequence[np.ndarray], min_tokens: int, max_tokens: int, max_total: int | None = None
                ) -> tuple[list[Group], list[int]]:
    """``(groups, alone)``: the groups worth sharing, and the datums left to the unshared path.

    Sorted lexicographically, a sequence's longest common prefix with its predecessor is its
    longest with any other sequence (a trie in depth-first order), and a run of sorted
    sequences shares the smallest of its neighbours' common prefixes. One level of groups:
    the runs are chosen to save the most tokens (an exact dynamic programme over the sorted
    order), a run's prefix being at least ``min_tokens`` long. A group whose row would exceed
    ``max_tokens`` unique tokens, or ``max_total`` tokens with the prefix counted per member
    (what its per-token outputs hold), is cut into several (each computes the prefix once); a
    group saving less than :data:`MIN_SAVED_FRACTION` of its tokens is not shared.
    """
    seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
    n = len(seqs)
    # big-endian bytes compare as the integer sequences do (tokens are non-negative)
    order = sorted(range(n), key=lambda i: seqs[i].astype(">i8").tobytes())
    lcp = np.zeros(n, dtype=np.int64)  # lcp[k]: sorted k-1 and k
    for k in range(1, n):
        lcp[k] = common_prefix(seqs[order[k - 1]], seqs[order[k]])
    best = np.zeros(n + 1, dtype=np.int64)  # the most tokens the first j sorted sequences can save
    start = np.arange(-1, n)  # where the last run of the best solution for j starts
    run = 0  # the first sorted index of the current chain of common prefixes >= min_tokens
    for j in range(1, n + 1):
        if lcp[j - 1] < min_tokens:
            run = j - 1
        best[j], start[j] = best[j - 1], j - 1
        if j - 1 - run < 1:
            continue
        # runs [i, j) for i in run .. j-2: prefix = min(lcp[i+1 .. j-1]), saving (j-1-i) * prefix
        prefixes = np.minimum.accumulate(lcp[run + 1:j][::-1])[::-1]
        firsts = np.arange(run, j - 1)
        saving = best[run:j - 1] + (j - 1 - firsts) * prefixes
        k = int(np.argmax(saving))
        if saving[k] > best[j]:
            best[j], start[j] = saving[k], run + k
    groups: list[Group] = []
    alone: list[int] = []
    j = n
    while j > 0:
        i = int(start[j])
        members = order[i:j]
        if len(members) == 1:
            alone.extend(members)
        else:
            _cut(seqs, members, int(lcp[i + 1:j].min()), max_tokens, min_tokens, groups, alone, max_total)
        j = i
    return groups[::-1], sorted(alone)


def _cut(seqs: Sequence[np.ndarray], members: list[int], prefix: int, max_tokens: int, min_tokens: int,
         groups: list[Group], alone: list[int], max_total: int | None = None) -> None:
    """Cut a run into groups of at most ``max_tokens`` unique tokens (and ``max_total`` tokens);
    keep those worth sharing."""

    def emit(chunk: list[int]) -> None:
        total = sum(len(seqs[m]) for m in chunk)
        unique = total - (len(chunk) - 1) * prefix
        if len(chunk) >= 2 and prefix >= min_tokens and total - unique >= MIN_SAVED_FRACTION * total:
            groups.append(Group(tuple(chunk), prefix, unique, total))
        else:
            alone.extend(chunk)

    chunk: list[int] = []
    used, total = prefix, 0
    for m in members:
        suffix = len(seqs[m]) - prefix
        if chunk and (used + suffix > max_tokens or (max_total is not None and total + len(seqs[m]) > max_total)):
            emit(chunk)
            chunk, used, total = [], prefix, 0
        chunk.append(m)
        used += suffix
        total += len(seqs[m])
    emit(chunk)


def fill_rows(groups: Sequence[Group], budget: int, max_total: int | None = None) -> list[list[Group]]:
    """Groups into rows (micro-batches) of at most ``budget`` unique tokens (and ``max_total``
    tokens with each prefix counted per member): first fit, largest first."""
    rows: list[list[Group]] = []
    used: list[tuple[int, int]] = []
    for g in sorted(groups, key=lambda g: -g.unique_tokens):
        for r, (u, t) in enumerate(used):
            if u + g.unique_tokens <= budget and (max_total is None or t + g.tokens <= max_total):
                rows[r].append(g)
                used[r] = (u + g.unique_tokens, t + g.tokens)
                break
        else:
            rows.append([g])
            used.append((g.unique_tokens, g.tokens))
    return rows


@attrs.frozen(eq=False)
class GroupSlots:
    """One group's place in the row, as the attention needs it."""

    start: int  #: first slot of the prefix
    prefix: int  #: prefix length P
    count: int  #: suffixes that are not empty (G)
    width: int  #: longest suffix (Smax)
    #: (G * Smax,) row slots of the suffixes right-padded to Smax (padding repeats a real slot)
    gather: torch.Tensor | None
    #: positions of the real suffix tokens in the padded (G * Smax) order
    unpad: torch.Tensor | None
    #: suffix rows per attention call (see :func:`expansion_rows`)
    rows: int = 0
    #: whether autograd keeps the calls' expanded prefix keys and values (else each call is
    #: recomputed in backward, so nothing of size G x P is kept)
    kept: bool = True


class PrefixPlan:
    """What the attention needs to know about a shared row: its groups, on one device.

    It travels to every attention layer as a keyword argument of the backbone's forward
    (:data:`~.prefix_attention.PLAN_KWARG`), so activation checkpointing's recompute sees
    it too. Masks are built once per shape and kept.
    """

    def __init__(self, groups: Sequence[GroupSlots], length: int) -> None:
        self.groups = list(groups)
        self.length = length
        self._masks: dict[tuple, torch.Tensor] = {}

    def to(self, device: torch.device | str) -> PrefixPlan:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        if all(g.gather is None or g.gather.device == torch.device(device) for g in self.groups):
            return self
        return PrefixPlan([attrs.evolve(g, gather=move(g.gather), unpad=move(g.unpad)) for g in self.groups],
                          self.length)

    def mask(self, queries: int, prefix: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor:
        """(1, 1, queries, keys) bool, True = may attend: query i is at position ``prefix + i``
        (a suffix, or with ``prefix=0`` the prefix itself), keys are at positions 0.. keys-1,
        causal and within ``window`` positions when one is given."""
        key = (queries, prefix, keys, window, str(device))
        if key not in self._masks:
            q = torch.arange(queries, device=device).view(queries, 1) + prefix
            k = torch.arange(keys, device=device).view(1, keys)
            m = k <= q
            if window is not None:
                m &= (q - k) < window
            self._masks[key] = m.view(1, 1, queries, keys)
        return self._masks[key]


@attrs.frozen(eq=False)
class SharedRow:
    """Groups laid out in one row: the model's inputs and each datum's slots."""

    input_ids: torch.Tensor  #: (1, N)
    position_ids: torch.Tensor  #: (1, N)
    paths: dict[int, np.ndarray]  #: datum -> its tokens' slots in the row, in order
    plan: PrefixPlan


@attrs.frozen
class ExpansionBudget:
    """How much of the attention's prefix expansion a shared row may keep for backward (``keep``
    slots) and hold at once (``chunk`` slots per call); None: no bound. See :func:`expansion_rows`."""

    keep: int | None = None
    chunk: int | None = None


def expansion_rows(counts_and_widths: Sequence[tuple[int, int, int]], budget: ExpansionBudget
                   ) -> list[tuple[int, bool]]:
    """Per group ``(count, prefix, width)``: ``(rows, kept)``, the suffix rows of one attention
    call and whether autograd keeps what the calls expand.

    The attention expands a group's prefix keys and values over its G suffix rows:
    G x (P + Smax) slots per layer (:mod:`.prefix_attention`), which a 1000-token prompt with
    256 samples makes 256 times the prefix, while the micro-batch budget counts each distinct
    token once. So the expansions one row keeps add up to at most ``budget.keep`` slots, groups
    in order, each in one call; a group that does not fit runs in calls of
    ``budget.chunk // (P + Smax)`` rows (at least one) whose expansion is recomputed in
    backward, never kept."""
    left = budget.keep
    out = []
    for count, prefix, width in counts_and_widths:
        slots = count * (prefix + width)
        if left is None or slots <= left:
            out.append((count, True))
            left = None if left is None else left - slots
        else:
            rows = count if budget.chunk is None else budget.chunk // (prefix + width)
            out.append((max(1, min(count, rows)), False))
    return out


def layout_groups(seqs: Sequence[np.ndarray], groups: Sequence[Group], expand: ExpansionBudget | None = None
                  ) -> SharedRow:
    """One row holding ``groups`` one after the other (see the module docstring); the
    attention's expansion of each group's prefix is bounded by ``expand`` (:func:`expansion_rows`)."""
    tokens: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    paths: dict[int, np.ndarray] = {}
    slots: list[GroupSlots] = []
    n = 0
    for group in groups:
        start, p = n, group.prefix
        tokens.append(np.asarray(seqs[group.members[0]][:p], dtype=np.int64))
        positions.append(np.arange(p))
        n += p
        suffixes = []
        for m in group.members:
            seq = np.asarray(seqs[m], dtype=np.int64)
            s = len(seq) - p
            tokens.append(seq[p:])
            positions.append(np.arange(p, len(seq)))
            paths[m] = np.concatenate([np.arange(start, start + p), np.arange(n, n + s)])
            if s > 0:
                suffixes.append((n, s))
            n += s
        slots.append(_group_slots(start, p, suffixes))
    rows = expansion_rows([(g.count, g.prefix, g.width) for g in slots], expand or ExpansionBudget())
    slots = [attrs.evolve(g, rows=r, kept=kept) for g, (r, kept) in zip(slots, rows, strict=True)]
    ids = torch.from_numpy(np.concatenate(tokens)).unsqueeze(0)
    pos = torch.from_numpy(np.concatenate(positions)).unsqueeze(0)
    return SharedRow(ids, pos, paths, PrefixPlan(slots, n))


def _group_slots(start: int, prefix: int, suffixes: list[tuple[int, int]]) -> GroupSlots:
    if not suffixes:
        return GroupSlots(start, prefix, 0, 0, None, None)
    width = max(s for _, s in suffixes)
    gather = np.empty((len(suffixes), width), dtype=np.int64)
    valid = np.zeros((len(suffixes), width), dtype=bool)
    for g, (b, s) in enumerate(suffixes):
        gather[g, :s] = np.arange(b, b + s)
        gather[g, s:] = b + s - 1  # padding: a real slot (its output is dropped, it is never attended)
        valid[g, :s] = True
    return GroupSlots(start, prefix, len(suffixes), width, torch.from_numpy(gather.reshape(-1)),
                      torch.from_numpy(np.flatnonzero(valid.reshape(-1))))
