"""Prefix sharing for an engine's model: switched on when the engine is built (if its
attention can take it), checked once on the real model at its first use (the first call
with datums to share), and reported (``get_info().prefix_sharing``).

The check runs two no-grad forwards of a few made-up datums (95 tokens) through the
engine's own :class:`~skyrl_sdk.models.scoring.ScoringModel`, shared and unshared, and keeps
sharing only when their scores agree: a plumbing error (a family that routes its attention
differently, a wrapper that drops the plan) turns sharing off with a warning instead of
training on wrong numbers. Exactness itself is what the test suite checks, in float32. It
waits for its first use so that an engine that never shares pays nothing for it (time,
memory, imports).
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
PENDING = " (self-test at the first use)"


class PrefixSharing:
    """One runner's prefix sharing: ``min_tokens`` to plan with (None: off) and ``status``."""

    def __init__(self, scoring: ScoringModel, min_tokens: int | None, *, float32: bool) -> None:
        self.scoring = scoring
        self.tolerance = CHECK_TOLERANCE[float32]
        self.min_tokens: int | None = None
        self.status = "off (engine_config prefix_sharing=false)"
        self.pending = False
        if min_tokens is None:
            return
        reason = prefix_attention.enable(scoring.model)  # for good: never toggled around a call
        if reason is not None:
            logger.info("prefix sharing off: %s", reason)
            self.status = f"off: {reason}"
            return
        self.min_tokens = min_tokens
        base = prefix_attention.BASES[hf_model(scoring.model).config._attn_implementation]
        self.status = f"on: two-part attention over {base}; heads of >= {min_tokens} tokens are computed once"
        self.pending = True
        self.status += PENDING

    def check(self, device: torch.device, any_rank: Callable[[bool], bool] = lambda flag: flag) -> None:
        """Run the self-test unless this model passed or failed it already (every rank of a
        sharded engine calls this at the same point: the test's forwards are collective)."""
        if not self.pending:
            return
        self.pending = False
        inner = hf_model(self.scoring.model)
        checked = getattr(inner, _CHECKED, None)
        if checked is None:
            try:
                diff = self_test(self.scoring, device)
            except Exception as exc:  # a family whose attention fails on shared rows: off, not broken
                logger.warning("prefix sharing's self-test raised %s: %s", type(exc).__name__, exc)
                diff = float("inf")
            checked = (not any_rank(not diff <= self.tolerance), diff)  # a NaN fails too
            setattr(inner, _CHECKED, checked)
        ok, diff = checked
        if ok:
            self.status = self.status.removesuffix(PENDING)
            return
        prefix_attention.disable(self.scoring.model)  # between calls: no backward is pending
        self.min_tokens = None
        self.status = f"off: the self-test found shared and unshared scores {diff:.3g} apart (> {self.tolerance:g})"
        logger.warning("prefix sharing %s", self.status)


def self_test_data(vocab_size: int, seed: int = 0) -> tuple[list[np.ndarray], list[Group]]:
    """Two groups (one with a member that is all prefix): 49 unique tokens of 95, long enough
    to cross a short sliding window (the test families use 8) at the prefix boundary."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab_size, 12)
    other = rng.integers(0, vocab_size, 10)
    seqs = [np.concatenate([head, rng.integers(0, vocab_size, n)]) for n in (5, 9, 3)] + [head.copy()]
    seqs += [np.concatenate([other, rng.integers(0, vocab_size, n)]) for n in (4, 6)]
    groups = [Group((0, 1, 2, 3), 12, 29), Group((4, 5), 10, 20)]
    return seqs, groups


@torch.no_grad()
def self_test(scoring: ScoringModel, device: torch.device) -> float:
    """Max abs difference between the shared and the unshared scores of :func:`self_test_data`,
    at each datum's middle and last token (a dozen rows of logits: the check leaves no trace
    in memory measurements), through the engine's own module (an FSDP root runs its hooks)."""
    seqs, groups = self_test_data(scoring.vocab_size)
    picks = [sorted({len(s) // 2, len(s) - 1}) for s in seqs]
    targets = None
    if scoring.role == "policy":
        rng = np.random.default_rng(1)
        targets = torch.from_numpy(rng.integers(0, scoring.vocab_size, sum(len(p) for p in picks))).to(device)
    row = layout_groups(seqs, groups)
    flat = torch.from_numpy(np.concatenate([row.paths[r][p] for r, p in enumerate(picks)])).to(device)
    shared, _ = scoring(row.input_ids.to(device), None, row.position_ids.to(device), flat, targets,
                        want_entropy=False, prefix=row.plan.to(device))
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.from_numpy(s)
        mask[r, :len(s)] = 1
    flat = torch.from_numpy(np.concatenate([r * width + np.asarray(p) for r, p in enumerate(picks)])).to(device)
    plain, _ = scoring(ids.to(device), mask.to(device), None, flat, targets, want_entropy=False)
    return float((shared.float() - plain.float()).abs().max())
