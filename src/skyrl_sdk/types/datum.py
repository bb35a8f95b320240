"""``Datum``: one training example, a sequence and its per-position loss inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import InputError
from .model_input import ModelInput, model_input_from_any
from .tensor import TensorData, to_tensor_data


def _loss_fn_inputs(value: Any) -> dict[str, TensorData]:
    if not isinstance(value, Mapping):
        raise InputError(f"loss_fn_inputs: expected a mapping of key -> tensor, got {type(value).__name__}")
    out = {}
    for key, tensor in value.items():
        if not isinstance(key, str) or not key:
            raise InputError(f"loss_fn_inputs: keys must be non-empty strings, got {key!r}")
        out[key] = to_tensor_data(tensor, key)
    return out


@attrs.frozen(eq=False)
class Datum:
    """One sequence and the per-position inputs of the loss.

    Position ``i`` of ``model_input`` predicts ``loss_fn_inputs["target_tokens"][i]``.
    """

    #: The sequence the model reads (a ModelInput, a tinker ModelInput, or a flat token list).
    model_input: ModelInput = attrs.field(converter=model_input_from_any)
    #: Per-position loss inputs by key (``target_tokens`` int64, every other key float32).
    loss_fn_inputs: dict[str, TensorData] = attrs.field(factory=dict, converter=_loss_fn_inputs)
