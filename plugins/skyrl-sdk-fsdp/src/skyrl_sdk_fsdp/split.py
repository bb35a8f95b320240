"""Splitting one call's datums across ranks, balanced by token count."""

from __future__ import annotations

from collections.abc import Sequence


def split_by_tokens(
    lengths: Sequence[int], world_size: int, together: Sequence[tuple[Sequence[int], int]] = (),
) -> list[list[int]]:
    """Assign datum indices to ranks so that every rank gets about the same number of tokens.

    Longest-processing-time greedy: units in decreasing cost, each onto the rank with the
    fewest tokens so far (ties: fewer datums, then lower rank). A unit is one datum (its
    length), or one of ``together``: datums that must stay on one rank (a shared-prefix group,
    computed there with its prefix once) with their cost (the group's unique tokens). Returns
    one ascending index list per rank; a rank may get none (fewer datums than ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    grouped = {i for members, _ in together for i in members}
    units = [([i], int(lengths[i])) for i in range(len(lengths)) if i not in grouped]
    units += [(sorted(members), int(cost)) for members, cost in together]
    units.sort(key=lambda u: (-u[1], u[0][0]))
    load = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for members, cost in units:
        rank = min(range(world_size), key=lambda r: (load[r], len(parts[r]), r))
        parts[rank].extend(members)
        load[rank] += cost
    return [sorted(p) for p in parts]
