"""What only the fsdp engine's tests share (a unique module name); the data builders and
comparison helpers come from :mod:`skyrl_sdk.testing`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.torch import load_file

#: Seconds after which a subprocess or a wait in these tests is taken as a hang: a guard, never
#: a speed check (cores shared with other jobs make runs many times slower than idle).
HANG_S = 1800.0

#: One datum per micro-batch on both engines, so that only FSDP (sharding, reduce-scatter,
#: rank split) differs between them: the batching layout itself moves float32 gradients by
#: ~3e-6 (padding width changes the attention kernels' rounding), the tolerance of these
#: tests is 1e-6.
ONE_PER_MICRO_BATCH = {"micro_batch_tokens": 1}

#: Uneven: 51 tokens in 5 datums of different lengths; with 2 ranks the token-balanced
#: split gives 27 and 24 tokens, 2 and 3 datums (so one rank also runs a dummy pass).
LENGTHS = [7, 12, 3, 20, 9]


def saved_weights(backend, path: Path) -> dict[str, np.ndarray]:
    """All weights of a Backend of any engine, read back from its save_state files."""
    backend.save_state(path)
    return {k: v.numpy() for k, v in load_file(str(path / "model.safetensors")).items()}
