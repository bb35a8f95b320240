"""Applying FSDP2 to a scoring model, from outside the training logic (as torchtitan does).

:func:`parallelize` shards every transformer block, the input embedding and the output head
(each its own unit when they are not tied), then the root, and makes gradients reduce by
SUM; nothing else in the plugin knows how the model is sharded.

Why the embedding and head get units of their own: in the root they (half of a 100M model's
parameters at a 32k vocabulary) would stay gathered, with their unsharded gradients, for the
whole step. As units, the embedding is gathered only for its own forward (its backward
needs no weight), and the head's gradient is reduce-scattered as soon as backward leaves it.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from skyrl_sdk.models import hf_model
from skyrl_sdk.models.activation_checkpointing import enable_activation_checkpointing, transformer_blocks
from skyrl_sdk.models.logprobs import FUSED_METHOD, fusable_linear, linear_target_logprobs
from skyrl_sdk.models.scoring import ScoringModel


class ShardedScoringModel(ScoringModel):
    """The FSDP root: never returns a view (an in-place op on a view output would drop
    FSDP2's pre-backward hook and skip an all-gather; the critic's ``squeeze`` is one)."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        scores, entropy = super().forward(*args, **kwargs)
        if scores._base is not None:
            scores = scores.clone()
        return scores, entropy


def parallelize(
    scoring: ShardedScoringModel, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
    compute_dtype: torch.dtype | None = None, gradient_checkpointing: bool = False, cpu_offload: bool = False,
) -> int:
    """``fully_shard`` every transformer block, then the root; gradients reduce by SUM.

    ``compute_dtype`` (when narrower than the parameters) turns on FSDP2 mixed precision;
    ``gradient_checkpointing`` checkpoints every block first (before ``fully_shard``);
    ``cpu_offload`` keeps every unit's shards in host memory (FSDP2's ``CPUOffloadPolicy``,
    pinned on CUDA: the module must then be materialized on the CPU, ``loading.materialize``).
    Returns the loss scale the runner must apply (1, or world size on a torch without
    ``set_force_sum_reduction_for_comms``, whose reduce-scatter averages).
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if gradient_checkpointing:
        enable_activation_checkpointing(scoring.model)
    policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    for block in transformer_blocks(scoring.model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
    embedding, head = untied_embedding_and_head(scoring)
    if embedding is not None:
        fully_shard(embedding, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
        if type(embedding) is torch.nn.Embedding:
            # a lookup's backward needs the indices, not the weight: no all-gather there
            cast(FSDPModule, embedding).set_unshard_in_backward(False)  # fully_shard made it one
    if head is not None:
        # last in forward, first in backward: keep it gathered in between (as FSDP2 does for a root)
        fully_shard(head, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
        setattr(head, FUSED_METHOD, types.MethodType(_fused_target_logprobs, head))
        register_fsdp_forward_method(head, FUSED_METHOD)
    fully_shard(scoring, mesh=mesh, mp_policy=policy, offload_policy=offload)
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


def untied_embedding_and_head(scoring: ScoringModel) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The input embedding and the policy's plain linear head, when they share no weight.

    A tied pair stays in the root (one parameter cannot live in two units); a head that is
    not a plain ``nn.Linear`` (LoRA-wrapped, soft-capped, a critic's value head) stays there
    too, since only the fused path is routed through the unit's hooks (``FUSED_METHOD``).
    """
    inner = hf_model(scoring.model)
    embedding = inner.get_input_embeddings()
    head = scoring.head.proj if scoring.role == "policy" else None
    shared = {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()} if head is not None else set()
    if shared:
        return None, None
    return embedding, fusable_linear(scoring.head) if head is not None else None


def _fused_target_logprobs(self: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                           want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The head unit's fused scoring, called through FSDP2's forward hooks: ``self.weight`` is
    the gathered weight here, and the gradient of ``hidden`` triggers the reduce-scatter."""
    lp, entropy = linear_target_logprobs(self.weight, self.bias, hidden, targets, chunk, want_entropy)
    # never a view out of an FSDP unit (see ShardedScoringModel); a copy of T floats
    return (lp.clone() if lp._base is not None else lp), entropy


def reshard(module: torch.nn.Module) -> None:
    """Drop every gathered copy (the optimizer updates the shards)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
