"""Moving one LoRA adapter's tensors (weights, pending gradients, AdamW state) to disk and back.

The file is safetensors (never pickle). Parameters keep their identity: offloading swaps
each parameter's storage for an empty tensor, so the adapter's optimizer, runner and peft
modules stay wired to the same objects and a reload restores every bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.checkpoint import load_tensors, save_tensors
from .runner import ModelRunner

_WEIGHT, _GRAD, _ADAM = "weight::", "grad::", "adam::"


def adapter_bytes(runner: ModelRunner) -> int:
    """Bytes an adapter holds in memory: its weights, pending gradients and AdamW state."""
    total = 0
    for _, p in runner.named_trainable():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    return total + runner.optimizer.state_bytes()


def offload(runner: ModelRunner, file: Path) -> None:
    """Write the adapter's tensors to ``file`` and free them (parameters become empty)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in runner.named_trainable():
        tensors[_WEIGHT + name] = p.detach()
        if p.grad is not None:
            tensors[_GRAD + name] = p.grad
    for key, value in runner.optimizer.state_items():
        tensors[_ADAM + key] = value
    save_tensors(tensors, file)
    for _, p in runner.named_trainable():
        p.grad = None
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    runner.optimizer.release()  # rebuilt over the same parameters on reload


def reload(runner: ModelRunner, file: Path, device: torch.device) -> None:
    """Bring back what :func:`offload` wrote (exactly), then delete the file."""
    tensors = load_tensors(file)
    for name, p in runner.named_trainable():
        p.data = tensors[_WEIGHT + name].to(device)
        grad = tensors.get(_GRAD + name)
        p.grad = None if grad is None else grad.to(device)
    moments = {k.removeprefix(_ADAM): v for k, v in tensors.items() if k.startswith(_ADAM)}
    if moments:
        runner.optimizer.load_state_tensors(moments)
    file.unlink()
