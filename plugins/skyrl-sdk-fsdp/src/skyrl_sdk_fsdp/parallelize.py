"""Applying FSDP2 to a scoring model, from outside the training logic (as torchtitan does).

:func:`parallelize` shards every transformer block, then the root, and makes gradients
reduce by SUM; nothing else in the plugin knows how the model is sharded.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from skyrl_sdk.engines import ScoringModel, enable_activation_checkpointing, transformer_blocks


class ShardedScoringModel(ScoringModel):
    """The FSDP root: never returns a view (an in-place op on a view output would drop
    FSDP2's pre-backward hook and skip an all-gather; the critic's ``squeeze`` is one)."""

    def forward(self, *args, **kwargs):
        scores, entropy = super().forward(*args, **kwargs)
        if scores._base is not None:
            scores = scores.clone()
        return scores, entropy


def parallelize(
    scoring: ShardedScoringModel, mesh, *, reshard_after_forward: bool = True,
    compute_dtype: torch.dtype | None = None, gradient_checkpointing: bool = False,
) -> int:
    """``fully_shard`` every transformer block, then the root; gradients reduce by SUM.

    ``compute_dtype`` (when narrower than the parameters) turns on FSDP2 mixed precision;
    ``gradient_checkpointing`` checkpoints every block first (before ``fully_shard``).
    Returns the loss scale the runner must apply (1, or world size on a torch without
    ``set_force_sum_reduction_for_comms``, whose reduce-scatter averages).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if gradient_checkpointing:
        enable_activation_checkpointing(scoring.model)
    policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(scoring.model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(scoring, mesh=mesh, mp_policy=policy)
    loss_scale = 1
    for m in scoring.modules():
        if not isinstance(m, FSDPModule):
            continue
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            # SUM semantics: the reduce-scatter adds the ranks' gradients (FSDP2 averages by
            # default; gloo has no PREMUL_SUM, hence the forced SUM with a divide factor of 1).
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
        else:  # pragma: no cover - older torch: undo the mean with a loss scale
            loss_scale = mesh.size()
    return loss_scale


def reshard(module: torch.nn.Module) -> None:
    """Drop every gathered copy (the optimizer updates the shards)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
