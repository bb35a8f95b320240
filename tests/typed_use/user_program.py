"""Checked by mypy (``tox -e typecheck``), never run: a user's program sees our signatures.

Each ``# type: ignore[...]`` below marks a call mypy must refuse; with ``warn_unused_ignores``
an ignore that nothing needs is itself an error, so if ``skyrl_sdk.Backend`` or ``LossInput``
were ``Any`` to a type checker (a lazy name without its TYPE_CHECKING import), this file fails.
"""

from __future__ import annotations

import skyrl_sdk
from skyrl_sdk import LossInput, LossOutput, types


def wrong_calls(batch: LossInput) -> LossOutput:
    skyrl_sdk.Backend(model=3)  # type: ignore[arg-type]
    skyrl_sdk.Backend(model="tiny").optim_step(types.AdamParams(), 1)  # type: ignore[call-arg]
    return LossOutput(loss=batch.target_logprobs.sum())  # type: ignore[union-attr]
