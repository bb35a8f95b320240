"""The trainer's tensors in host memory while a colocated sampler samples
(``engine_config["offload_while_sampling"]``).

What verl's parameter and optimizer offload does for its FSDP workers, for an in-process
engine on one device: before the sampler (vLLM, with its own copy of the weights) takes the
GPU, every parameter (trained and frozen), every pending gradient and the AdamW moments move
to host memory; before the next call that computes, they come back. Parameters keep their
identity (each ``p.data`` is swapped, as :mod:`.offload` does for adapters on disk), so the
optimizer, the runner and peft stay wired to the same objects and a round trip restores every
bit. Host copies are pinned when they come from CUDA, so both directions are DMA copies; one
synchronize ends each move, and the freed device blocks go back to the driver
(``empty_cache``) for the sampler to use.

Cost: the bytes moved (:attr:`TrainerOffload.last_bytes`) twice per RL step over PCIe, about
a second per 25 GB each way on a recent GPU, and the same bytes of pinned host memory.
"""

from __future__ import annotations

import logging

import torch

from .optimizer import Optimizer

logger = logging.getLogger(__name__)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned when ``t`` is on CUDA, copied without waiting)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    out.copy_(t, non_blocking=t.is_cuda)
    return out


def _device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of host tensor ``t`` on ``device`` (a fresh one on CPU too: a round trip always
    swaps storage, which is what the tests on CPU check)."""
    return t.to(device, non_blocking=t.is_pinned(), copy=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class TrainerOffload:
    """One engine's move of its model's and optimizer's tensors to host memory and back."""

    def __init__(self, module: torch.nn.Module, optimizer: Optimizer, device: torch.device) -> None:
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.offloaded = False
        #: moves done each way (tests and the GPU check read them)
        self.offloads = 0
        self.reloads = 0
        #: bytes the last offload moved to host memory
        self.last_bytes = 0
        #: where each optimizer-state tensor lived (AdamW keeps ``step`` on the CPU unless fused)
        self._home: dict[tuple[int, str], torch.device] = {}

    def _each_parameter(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for p in self.module.parameters()}.values())

    def _moments(self) -> list[tuple[dict, str]]:
        """(state dict, key) of every tensor of the optimizer's state."""
        opt = self.optimizer.torch_optimizer
        if opt is None:
            return []
        return [(state, key) for state in opt.state.values() for key, v in state.items() if torch.is_tensor(v)]

    def to_host(self) -> bool:
        """Move everything to host memory (nothing when it is there already); True when it moved."""
        if self.offloaded:
            return False
        moved = 0
        for p in self._each_parameter():
            grad, p.grad = p.grad, None
            p.data = _host_copy(p.data)
            moved += p.numel() * p.element_size()
            if grad is not None:
                p.grad = _host_copy(grad)
                moved += grad.numel() * grad.element_size()
        for state, key in self._moments():
            value = state[key]
            self._home[(id(state), key)] = value.device
            state[key] = _host_copy(value)
            moved += value.numel() * value.element_size()
        _synchronize(self.device)
        self.offloaded, self.last_bytes = True, moved
        self.offloads += 1
        logger.debug("trainer offloaded to host memory: %.1f MiB", moved / 2**20)
        return True

    def to_device(self) -> None:
        """Bring back what :meth:`to_host` moved (a no-op when nothing is offloaded)."""
        if not self.offloaded:
            return
        for p in self._each_parameter():
            grad, p.grad = p.grad, None
            p.data = _device_copy(p.data, self.device)
            if grad is not None:
                p.grad = _device_copy(grad, self.device)
        for state, key in self._moments():
            state[key] = _device_copy(state[key], self._home.pop((id(state), key), self.device))
        _synchronize(self.device)
        self.offloaded = False
        self.reloads += 1
