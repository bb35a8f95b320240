"""Splitting one call's datums across ranks, balanced by token count."""

from __future__ import annotations

from collections.abc import Sequence


def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Assign datum indices to ranks so that every rank gets about the same number of tokens.

    Longest-processing-time greedy: datums in decreasing length, each onto the rank with the
    fewest tokens so far (ties: fewer datums, then lower rank). Returns one ascending index
    list per rank; a rank may get none (fewer datums than ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    load = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for idx in order:
        rank = min(range(world_size), key=lambda r: (load[r], len(parts[r]), r))
        parts[rank].append(idx)
        load[rank] += int(lengths[idx])
    return [sorted(p) for p in parts]
