"""``Datum``: one training example, a sequence and its per-position loss inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import InputError
from .model_input import ModelInput, model_input_from_any
from .provenance import ProvenanceSpan, check_tiling, spans_from_any
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


def _model_input_spans(value: Any) -> tuple[ProvenanceSpan, ...] | None:
    return spans_from_any(value, "model_input_spans")


def _loss_fn_input_spans(value: Any) -> tuple[ProvenanceSpan, ...] | None:
    return spans_from_any(value, "loss_fn_input_spans")


@attrs.frozen(eq=False)
class Datum:
    """One sequence and the per-position inputs of the loss.

    Position ``i`` of ``model_input`` predicts ``loss_fn_inputs["target_tokens"][i]``.
    Provenance (optional, both lists or neither, as Tinker's ``Datum.with_provenance``) names
    the sampled sequence behind each position; ``stable_reinforce`` needs it.
    """

    #: The sequence the model reads (a ModelInput, a tinker ModelInput, or a flat token list).
    model_input: ModelInput = attrs.field(converter=model_input_from_any)
    #: Per-position loss inputs by key (``target_tokens`` int64, every other key float32).
    loss_fn_inputs: dict[str, TensorData] = attrs.field(factory=dict, converter=_loss_fn_inputs)
    #: Runs tiling ``model_input``: which recorded sequence each input token came from.
    model_input_spans: tuple[ProvenanceSpan, ...] | None = attrs.field(
        default=None, converter=_model_input_spans)
    #: Runs tiling ``target_tokens`` (one per position): which recorded sequence each target came from.
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = attrs.field(
        default=None, converter=_loss_fn_input_spans)

    def __attrs_post_init__(self) -> None:
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise InputError("provenance comes as a pair: set both model_input_spans and loss_fn_input_spans, "
                             "or neither")
        if self.model_input_spans is None:
            return
        check_tiling("model_input_spans", self.model_input_spans, self.model_input.length)
        targets = self.loss_fn_inputs.get("target_tokens")
        if targets is not None and len(targets.shape) == 1 and self.loss_fn_input_spans is not None:
            check_tiling("loss_fn_input_spans", self.loss_fn_input_spans, targets.shape[0])

    def with_provenance(self, model_input: Any, loss_fn_inputs: Any) -> Datum:
        """A copy carrying provenance: ``model_input`` spans tile the input tokens,
        ``loss_fn_inputs`` spans tile ``target_tokens`` (Tinker's method of the same name)."""
        return attrs.evolve(self, model_input_spans=model_input, loss_fn_input_spans=loss_fn_inputs)
