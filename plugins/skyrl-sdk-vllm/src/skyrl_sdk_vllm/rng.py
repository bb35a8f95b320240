"""vLLM's random draws and the trainer's, kept apart in one process.

vLLM runs in the trainer's process (``loading``) and treats the process's global generators as
its own: starting an engine seeds Python's ``random``, numpy's and torch's (CPU and every CUDA
device) with the engine's seed ("The global random seed is set to 0"), and an unseeded sample
draws from torch's. A trainer that seeded them for its own data order or dropout would find them
reset. So every call into vLLM runs inside :meth:`RngStreams.vllm`: the caller's states are
saved, vLLM's own are put in place (its seeded start the first time), and on the way out vLLM's
are kept for its next call and the caller's restored, bit for bit. The trainer's draws are then
what they would be without vLLM, and vLLM's unseeded samples still continue one stream (two
calls do not repeat each other's draws).

The generators are the process's: two engines swapping at once from two threads (a server's
models) would save each other's states as the caller's. So a swap holds one process-wide lock
(:data:`SWAP_LOCK`, taken after the engine's own lock, never the other way round); a thread that
draws from the global generators *while* another thread is inside vLLM still draws from vLLM's.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The process's global generator states: Python's, numpy's, torch's CPU and, once CUDA is
    initialized, every CUDA device's."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


#: held for the whole of one engine's swap (see the module docstring)
SWAP_LOCK = threading.RLock()
#: the seed a CUDA generator starts from when nothing seeded it (torch's ``default_rng_seed_val``)
CUDA_DEFAULT_SEED = 67280421310721


def restore(states: dict[str, Any]) -> None:
    """Put back what :func:`capture` returned. CUDA generators captured before CUDA was initialized
    (vLLM initialized it) go back to the state a fresh one starts in."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(CUDA_DEFAULT_SEED)


class RngStreams:
    """One engine's generator states, swapped in around each call into it (module docstring).

    Reentrant per thread: an engine method that calls another inside the same swap keeps one
    swap. Calls into one engine hold its lock, so one thread at a time is inside."""

    def __init__(self) -> None:
        self._engine: dict[str, Any] | None = None  # vLLM's states between its calls (None: not started)
        self._depth = threading.local()
        #: completed swaps (tests)
        self.swaps = 0

    @contextlib.contextmanager
    def vllm(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        if depth:
            self._depth.n = depth + 1
            try:
                yield
            finally:
                self._depth.n = depth
            return
        with SWAP_LOCK:
            caller = capture()
            if self._engine is not None:
                restore(self._engine)
            self._depth.n = 1
            try:
                yield
            finally:
                self._depth.n = 0
                self._engine = capture()
                restore(caller)
                self.swaps += 1
