"""Activation checkpointing per transformer block, for any engine and any wrapper.

transformers' own ``gradient_checkpointing_enable`` only acts in ``train()`` mode, and the
engines keep models in ``eval()`` (no dropout: the trainer's logprobs must match the
sampler's). So each block's ``forward`` is replaced, on the instance, by a call through
``torch.utils.checkpoint`` (non-reentrant): only the block's inputs are kept, its
activations are recomputed in backward with the same ops, hence the same gradients.
Parameter names, state dicts and hooks registered on the block (FSDP2's all-gather hooks
run in ``__call__``, around ``forward``) are unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import InputError
from .loading import hf_model

#: Marks a block whose forward is already checkpointed (enabling twice is a no-op).
_MARK = "_skyrl_checkpointed_forward"


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


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # scoring without backward, sampling: nothing to save
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def enable_activation_checkpointing(module: torch.nn.Module) -> int:
    """Checkpoint every transformer block of ``module``; returns how many blocks.

    With FSDP2, call it before ``fully_shard`` (it only wraps ``forward``, so the order is
    not critical, but that is the documented one).
    """
    blocks = transformer_blocks(module)
    if not blocks:
        raise InputError(f"engine_config['gradient_checkpointing']: {type(hf_model(module)).__name__} has no "
                         "transformer blocks to checkpoint")
    for block in blocks:
        if getattr(block, _MARK, False):
            continue
        block.forward = _checkpointed(block.forward)
        setattr(block, _MARK, True)
    return len(blocks)
