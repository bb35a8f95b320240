"""The trainer side of vLLM's own ``nccl`` weight-transfer backend (GPUs in different processes or
machines): rank 0 broadcasts each whole tensor to every engine's workers.

vLLM's worker side (``NCCLWeightTransferEngine``) joins a group of ``1 + tensor_parallel_size``
ranks through ``StatelessProcessGroup`` and receives tensor by tensor (``packed=False``) from rank
0. Here rank 0 joins the same group as a client of the store the controller hosts (vLLM's own
trainer helper would host it on rank 0's node, whose free ports the controller cannot know), and
broadcasts the tensors the source yields whole (a ``gathered`` layout: the fsdp ranks all-gather
each tensor, one at a time; the other ranks only take part in those gathers).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from skyrl_sdk.plugins.weight_push import PushLayout, WeightSender


class NcclSender(WeightSender):
    """Rank 0's NCCL communicators, one per engine (``groups``: ``{"host", "port", "world_size"}``)."""

    def __init__(self, *, groups: Sequence[Mapping[str, Any]], timeout_s: float) -> None:
        self.specs = [dict(g) for g in groups]
        self.timeout_s = float(timeout_s)
        self.comms: list[Any] | None = None

    def _join(self) -> list[Any]:
        if self.comms is None:
            import torch.distributed as dist
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            device = torch.cuda.current_device()
            comms = []
            for g in self.specs:
                store = dist.TCPStore(g["host"], int(g["port"]), None, False,
                                      timeout=timedelta(seconds=self.timeout_s))
                group = StatelessProcessGroup(rank=0, world_size=int(g["world_size"]), store=store)
                comms.append(PyNcclCommunicator(group, device=device))
            self.comms = comms
        return self.comms

    def send(self, rank: int, layout: PushLayout, slices: Iterator[torch.Tensor]) -> None:
        if rank != 0:  # the other ranks only take part in the gathers that feed rank 0
            for _ in slices:
                pass
            return
        comms = self._join()
        stream = torch.cuda.current_stream()
        for spec, tensor in zip(layout.tensors, slices, strict=True):
            tensor = tensor.to("cuda", non_blocking=True).contiguous()
            if tuple(tensor.shape) != spec.shape:
                raise RuntimeError(f"nccl push: {spec.name} is {tuple(tensor.shape)}, the layout says {spec.shape}")
            for comm in comms:
                comm.broadcast(tensor, src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        self.comms = None
