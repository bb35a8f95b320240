"""A weight sender that records what each rank sends (``tests/test_fsdp_push.py``): the ranks
import it by name, as they import a sampler plugin's sender."""

from __future__ import annotations

from pathlib import Path

import torch

from skyrl_sdk.plugins.weight_push import WeightSender


class Recorder(WeightSender):
    """Writes rank r's slices to ``<directory>/rank<r>.pt`` (test data of our own)."""

    def __init__(self, *, directory: str) -> None:
        self.directory = Path(directory)

    def send(self, rank, layout, slices) -> None:
        torch.save([s.detach().clone() for s in slices], self.directory / f"rank{rank}.pt")
