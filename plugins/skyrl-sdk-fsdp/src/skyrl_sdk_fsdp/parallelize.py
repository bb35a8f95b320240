"""Applying FSDP2 to a scoring model, from outside the training logic (as torchtitan does).

:func:`parallelize` shards every transformer block, then the root, and makes gradients
reduce by SUM; nothing else in the plugin knows how the model is sharded.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from skyrl_sdk.engines import ScoringModel, hf_model


class ShardedScoringModel(ScoringModel):
    """The FSDP root: never returns a view (an in-place op on a view output would drop
    FSDP2's pre-backward hook and skip an all-gather; the critic's ``squeeze`` is one)."""

    def forward(self, *args, **kwargs):
        scores, entropy = super().forward(*args, **kwargs)
        if scores._base is not None:
            scores = scores.clone()
        return scores, entropy


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (its ``_no_split_modules`` classes)."""
    inner = hf_model(module)
    names = set(getattr(inner, "_no_split_modules", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    for m in module.modules():  # fallback: the longest ModuleList is the block stack
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(blocks):
            blocks = list(m)
    return blocks


def parallelize(scoring: ShardedScoringModel, mesh, *, reshard_after_forward: bool = True) -> int:
    """``fully_shard`` every transformer block, then the root; gradients reduce by SUM.

    Returns the loss scale the runner must apply (1, or world size on a torch without
    ``set_force_sum_reduction_for_comms``, whose reduce-scatter averages).
    """
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(scoring.model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(scoring, mesh=mesh)
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
