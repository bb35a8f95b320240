"""The shared :class:`ModelRunner` on an FSDP2 module: the same collectives on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from skyrl_sdk.engines import EngineResult, ModelRunner, ResolvedLoss
from skyrl_sdk.models.scoring import ScoringModel
from skyrl_sdk.types import Datum

from .parallelize import reshard


class ShardedRunner(ModelRunner):
    """:class:`ModelRunner` on an FSDP2 module: equal micro-batch counts on every rank.

    Every rank must run the same number of forward (and backward) passes, because each one
    all-gathers (and reduce-scatters) the shards. A rank with fewer micro-batches than the
    busiest one runs zero-weight dummy passes (one pad token, loss multiplied by 0).
    """

    def __init__(self, scoring: ScoringModel, *, group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(scoring, **kwargs)
        self.group = group

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        norm = super().grad_norm(grads)  # DTensor grads: a replicated global norm
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def any_rank(self, flag: bool) -> bool:
        """OR over ranks: the AdamW step guard must roll back on every rank or on none."""
        value = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def run(
        self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool, batches: list | None = None,
        keep_grads_on_error: bool | None = None,
    ) -> EngineResult:
        """:meth:`ModelRunner.run` with the same collectives on every rank. Each rank plans its own
        ``batches`` here (planning may be collective), so a precomputed plan is refused."""
        if batches is not None:
            raise ValueError("ShardedRunner.run: batches must be None (every rank plans its own micro-batches)")
        pending = self.prefix.pending
        # every rank plans, data or not: while prefix sharing is unchecked, planning asks every
        # rank whether it would share, and then all run the self-test (its forwards are collective)
        batches = self.plan(data)
        if pending and not self.prefix.pending:
            reshard(self.scoring_model())  # the self-test's no-grad forwards left the root gathered
        mine = len(batches)
        count = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        result = super().run(data, loss, backward=backward, batches=batches,
                             keep_grads_on_error=keep_grads_on_error)
        for _ in range(int(count.item()) - mine):
            self._dummy_pass(backward)
        # A no-grad forward leaves the root (and, with reshard_after_forward=False, the
        # blocks) gathered; the optimizer updates the shards, so drop the gathered copies.
        reshard(self.scoring_model())
        return result

    def _dummy_pass(self, backward: bool) -> None:
        dev = self.device
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=dev)
        index = torch.zeros(1, dtype=torch.long, device=dev)
        scoring = self.scoring_model()
        targets = index if scoring.role == "policy" else None
        with torch.enable_grad() if backward else torch.no_grad():
            scores, _ = scoring(ids, None, None, index, targets, want_entropy=False)
            if backward:
                (scores.sum() * 0.0).backward()
