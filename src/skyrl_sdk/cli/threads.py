"""How many CPU threads torch uses in the commands that compute (``demo``, ``serve``): one by default.

torch starts one OpenMP thread per core, and those threads spin-wait for each other. On a
machine whose cores other jobs also use, a thread that lost its core stalls the rest: on 2
shared cores the demo took 4-5x longer with torch's 2 threads than with 1 (docs/performance.md,
"Threads on shared cores"). So the commands pick 1 thread unless told otherwise:
``--threads N``, or ``OMP_NUM_THREADS`` in the environment (torch then reads it as usual).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

DEFAULT_THREADS = 1


def positive_int(text: str) -> int:
    """argparse type of ``--threads``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def choose(requested: int | None, environ: Mapping[str, str] = os.environ) -> tuple[int | None, str]:
    """``(threads to set or None to leave torch's choice, why)``."""
    if requested is not None:
        return requested, "--threads"
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, "OMP_NUM_THREADS"
    return DEFAULT_THREADS, "the default on CPU; --threads N to change"


def apply(requested: int | None) -> str:
    """Set torch's intra-op threads as :func:`choose` says; return a note for the user."""
    import torch

    threads, why = choose(requested)
    if threads is not None:
        torch.set_num_threads(threads)
    n = torch.get_num_threads()
    return f"{n} CPU thread{'s' if n != 1 else ''} ({why})"
