"""Shared fixtures (the public test helpers of :mod:`skyrl_sdk.testing`) and the hypothesis
profiles of the fuzz suites: ``ci`` (short, the default) and ``long`` (``HYPOTHESIS_PROFILE=long``)."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

from skyrl_sdk.testing import fresh_plugins, plugin_site, sft_data, tiny_backend  # noqa: F401  (fixtures)

# One thread: on cores other jobs share, torch's threads stall each other (README, "Running
# on CPU"); tox also sets OMP_NUM_THREADS=1 for the scripts the tests start.
torch.set_num_threads(1)

_FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("ci", max_examples=40, derandomize=True, **_FUZZ)
settings.register_profile("long", max_examples=2000, **_FUZZ)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
