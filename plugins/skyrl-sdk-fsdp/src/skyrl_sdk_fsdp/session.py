"""This process's place in the process group (:class:`DistSession`) and joining it.

A spawned rank joins a private group through the controller's TCP store; under torchrun the
group comes from the launcher's environment (see :class:`~.dispatch.TorchrunJob`).
"""

from __future__ import annotations

import ctypes
import datetime
import sys
from typing import Any

import attrs
import torch
import torch.distributed as dist


@attrs.define
class DistSession:
    """This process's place in the process group (one per process, shared by its engines)."""

    rank: int
    world_size: int
    local_rank: int
    #: "cuda" or "cpu": the device type of the ranks
    device_type: str
    #: gloo group for controller requests (torchrun launcher only)
    control_group: Any = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Host allocations at least this large are mmap-ed, and so go back to the OS when freed.
MMAP_THRESHOLD_BYTES = 128 * 1024


def release_freed_host_memory() -> bool:
    """Make this process hand large freed host buffers back to the OS (glibc only).

    FSDP all-gathers each block's parameters into fresh buffers of a few to tens of MB and
    frees them after use. glibc's dynamic mmap threshold soon rises above that size, so the
    freed buffers stay in the heap as resident memory: on the 100M-parameter benchmark
    (docs/performance.md) each rank then peaked at the local engine's full RSS (1.01x);
    with mmap-ed large buffers the peak is 0.65x. Returns whether it applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False


def init_session(
    *, rank: int, world_size: int, local_rank: int, device_type: str, timeout_s: float,
    store: Any = None, control_group: bool = False,
) -> DistSession:
    """Join the process group (from ``store``, or from the launcher's env variables)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    release_freed_host_memory()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        kwargs: dict[str, Any] = dict(backend=backend, timeout=timeout, rank=rank, world_size=world_size)
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = "env://"
        dist.init_process_group(**kwargs)
    session = DistSession(rank=rank, world_size=world_size, local_rank=local_rank, device_type=device_type)
    if control_group:
        # Idle ranks wait here for the next request for as long as the user's script runs.
        session.control_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return session
