"""Shared fixtures: the public test helpers of :mod:`skyrl_sdk.testing`."""

from __future__ import annotations

import torch

from skyrl_sdk.testing import fresh_plugins, plugin_site, sft_data, tiny_backend  # noqa: F401  (fixtures)

# One thread: on cores other jobs share, torch's threads stall each other (README, "Running
# on CPU"); tox also sets OMP_NUM_THREADS=1 for the scripts the tests start.
torch.set_num_threads(1)
