"""Shared fixtures: the public test helpers of :mod:`skyrl_sdk.testing`."""

from __future__ import annotations

import torch

from skyrl_sdk.testing import fresh_plugins, plugin_site, sft_data, tiny_backend  # noqa: F401  (fixtures)

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
