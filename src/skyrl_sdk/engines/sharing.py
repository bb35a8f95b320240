"""Prefix sharing for an engine's model: switched on at load when its attention can take it,
checked once on the real model, and reported (``get_info().prefix_sharing``).

The check runs two no-grad forwards of a few made-up datums (about 300 tokens) through the
engine's own :class:`~skyrl_sdk.models.scoring.ScoringModel`, shared and unshared, and keeps
sharing only when their scores agree: a plumbing error (a family that routes its attention
differently, a wrapper that drops the plan) turns sharing off with a warning instead of
training on wrong numbers. Exactness itself is what the test suite checks, in float32.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from ..models import prefix_attention
from ..models.loading import hf_model
from ..models.prefix import Group, layout_groups
from ..models.scoring import ScoringModel

logger = logging.getLogger(__name__)

#: The self-test's tolerance on scores (max abs difference), by compute dtype: float32's
#: rounding, or bfloat16's (where shared and unshared differ by ~1e-3 with a correct plumbing).
CHECK_TOLERANCE = {True: 1e-4, False: 3e-2}
#: Attribute of the HF model that remembers the check (engines may build several runners on one model).
_CHECKED = "_skyrl_prefix_checked"


def start_prefix_sharing(
    scoring: ScoringModel, min_tokens: int | None, device: torch.device, *, float32: bool,
    any_rank: Callable[[bool], bool] = lambda flag: flag,
) -> tuple[int | None, str]:
    """Switch ``scoring``'s model to prefix-aware attention and check it once; returns the
    minimum shared length to plan with (None: sharing is off) and a status line."""
    if min_tokens is None:
        return None, "off (engine_config prefix_sharing=false)"
    model = scoring.model
    reason = prefix_attention.enable(model)
    if reason is not None:
        logger.info("prefix sharing off: %s", reason)
        return None, f"off: {reason}"
    inner = hf_model(model)
    checked = getattr(inner, _CHECKED, None)
    if checked is None:
        tolerance = CHECK_TOLERANCE[float32]
        try:
            diff = self_test(scoring, device)
        except Exception as exc:  # a family whose attention fails on shared rows: off, not broken
            logger.warning("prefix sharing's self-test raised %s: %s", type(exc).__name__, exc)
            diff = float("inf")
        checked = (not any_rank(not diff <= tolerance), diff, tolerance)  # a NaN fails too
        setattr(inner, _CHECKED, checked)
    ok, diff, tolerance = checked
    if not ok:
        prefix_attention.disable(model)
        logger.warning("prefix sharing off: its self-test found shared and unshared scores %.3g apart (> %g)",
                       diff, tolerance)
        return None, f"off: the self-test found shared and unshared scores {diff:.3g} apart (> {tolerance:g})"
    base = prefix_attention.BASES[inner.config._attn_implementation]
    return min_tokens, f"on: two-part attention over {base}; heads of >= {min_tokens} tokens are computed once"


def self_test_data(vocab_size: int, seed: int = 0) -> tuple[list[np.ndarray], list[Group]]:
    """Two groups (one with a member that is all prefix): 134 unique tokens of 278."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab_size, 40)
    other = rng.integers(0, vocab_size, 24)
    seqs = [np.concatenate([head, rng.integers(0, vocab_size, n)]) for n in (12, 25, 7)] + [head.copy()]
    seqs += [np.concatenate([other, rng.integers(0, vocab_size, n)]) for n in (10, 16)]
    groups = [Group((0, 1, 2, 3), 40, 84), Group((4, 5), 24, 50)]
    return seqs, groups


@torch.no_grad()
def self_test(scoring: ScoringModel, device: torch.device) -> float:
    """Max abs difference between the shared and the unshared scores of :func:`self_test_data`."""
    seqs, groups = self_test_data(scoring.vocab_size)
    rng = np.random.default_rng(1)
    targets = None
    if scoring.role == "policy":
        targets = torch.from_numpy(np.concatenate([rng.integers(0, scoring.vocab_size, len(s)) for s in seqs]))
        targets = targets.to(device)
    row = layout_groups(seqs, groups)
    order = [m for g in groups for m in g.members]
    flat = torch.from_numpy(np.concatenate([row.paths[m] for m in order])).to(device)
    shared, _ = scoring(row.input_ids.to(device), None, row.position_ids.to(device), flat, targets,
                        want_entropy=False, prefix=row.plan.to(device))
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.from_numpy(s)
        mask[r, :len(s)] = 1
    plain, _ = scoring(ids.to(device), mask.to(device), None,
                       torch.from_numpy(np.flatnonzero(mask.reshape(-1).numpy())).to(device), targets,
                       want_entropy=False)
    return float((shared.float() - plain.float()).abs().max())
