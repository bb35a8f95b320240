"""The check every loss input passes: required keys, no unknown keys, shapes aligned to the tokens.

It lives in the loss layer because both the Backend (before any compute) and
:func:`evaluate_loss` (model-free) need it, and the loss layer must not reach up into the
facade.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import DatumError, did_you_mean
from .base import LossSpec


def check_loss_inputs(
    spec: LossSpec, shapes: Mapping[str, tuple[int, ...]], n: int, *, index: int, need_targets: bool = True,
    label: str | None = None,
) -> None:
    """Required keys present, no unknown keys, first dimension equal to the datum length.

    ``label`` names the loss as the caller typed it (``ResolvedLoss.label``)."""
    label = label or f"loss {spec.name!r}"
    accepted = set(spec.required_inputs) | set(spec.optional_inputs)
    for key in spec.required_inputs:
        if key == "target_tokens" and not need_targets:
            continue
        if key not in shapes:
            raise DatumError(
                f"{label} requires input {key!r} (required: {list(spec.required_inputs)}), "
                f"got keys {sorted(shapes)}",
                index=index,
            )
    for key, shape in shapes.items():
        if key not in accepted:
            raise DatumError(
                f"{label} does not take this input; accepted inputs: "
                f"{sorted(accepted)}{did_you_mean(key, accepted)}",
                index=index,
                key=key,
            )
        if len(shape) == 0 or shape[0] != n:
            raise DatumError(
                f"expected first dimension {n} (the model_input length), got shape {list(shape)}",
                index=index,
                key=key,
            )
        topk_ok = spec.accepts_topk_targets and key in ("target_tokens", "weights")
        if len(shape) != 1 and not (topk_ok and len(shape) == 2):
            expected = "(N,) or (N, K)" if topk_ok else "(N,)"
            raise DatumError(f"expected shape {expected} with N={n}, got {list(shape)}", index=index, key=key)
    if spec.accepts_topk_targets and "target_tokens" in shapes and "weights" in shapes:
        if shapes["target_tokens"] != shapes["weights"]:
            raise DatumError(
                f"weights shape {list(shapes['weights'])} must equal target_tokens shape "
                f"{list(shapes['target_tokens'])}",
                index=index,
                key="weights",
            )
