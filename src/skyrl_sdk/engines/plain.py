"""Plain-data forms of an engine call, for engines whose ranks run in other processes.

Only numpy arrays and Python builtins cross the process boundary (nothing that needs pickle
of torch objects or of plugin classes): the receiving side rebuilds the typed objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import PluginError
from ..losses.base import LossSpec
from ..losses.resolve import ResolvedLoss
from ..losses.terms import LossTerms
from ..types import (
    Datum,
    EncodedTextChunk,
    ModelInput,
    PreparedImageChunk,
    SampleRequest,
    SamplingParams,
    TensorData,
)


def loss_to_plain(loss: ResolvedLoss) -> dict[str, Any]:
    """A resolved loss as its name, config fields and the names the caller used."""
    config = attrs.asdict(loss.config, recurse=False) if loss.config is not None else None
    return dict(name=loss.spec.name, config=config, requested_name=loss.requested_name, dialect=loss.dialect,
                terms=attrs.asdict(loss.terms), plugin=loss.plugin, scores_only=loss.scores_only)


def loss_from_plain(plain: dict[str, Any], losses: Mapping[str, LossSpec], where: str = "this process") -> ResolvedLoss:
    """Rebuild a :func:`loss_to_plain` loss from ``losses``, this process's registered losses
    (``skyrl_sdk.get_registry().losses``)."""
    spec = losses.get(plain["name"])
    if spec is None:
        raise PluginError(
            f"loss {plain['name']!r} is not registered on {where}: install the plugin that provides it "
            f"where the ranks run (plugins load from entry points in every process)"
        )
    config = spec.config_cls(**plain["config"]) if spec.config_cls is not None else None
    return ResolvedLoss(spec=spec, config=config, requested_name=plain["requested_name"], dialect=plain["dialect"],
                        terms=LossTerms(**plain["terms"]), plugin=plain["plugin"], scores_only=plain["scores_only"])


def model_input_to_plain(model_input: ModelInput) -> tuple:
    """``(token ids,)``, or ``(token ids, images)`` for a sequence holding prepared images: each
    image its position in the sequence and its fields."""
    tokens = model_input.to_numpy()
    if not model_input.has_images:
        return (tokens,)
    images, start = [], 0
    for chunk in model_input.chunks:
        if isinstance(chunk, PreparedImageChunk):
            images.append(dict(start=start, pixel_values=chunk.pixel_values, grid_thw=list(chunk.grid_thw),
                               merge_size=chunk.merge_size, token_id=chunk.token_id, digest=chunk.digest))
        start += chunk.length
    return tokens, images


def model_input_from_plain(plain: Sequence) -> ModelInput:
    """The sequence :func:`model_input_to_plain` describes."""
    tokens = np.asarray(plain[0], dtype=np.int64)
    if len(plain) == 1:
        return ModelInput.from_ints(tokens)
    chunks: list = []
    start = 0
    for image in plain[1]:
        fields = dict(image)
        at = fields.pop("start")
        if at > start:
            chunks.append(EncodedTextChunk(tokens[start:at]))
        chunk = PreparedImageChunk(**{**fields, "grid_thw": tuple(int(x) for x in fields["grid_thw"])})
        chunks.append(chunk)
        start = at + chunk.length
    if start < len(tokens):
        chunks.append(EncodedTextChunk(tokens[start:]))
    return ModelInput(chunks)


def datums_to_plain(data: Sequence[Datum]) -> list[tuple[tuple, dict[str, np.ndarray]]]:
    """Each datum as ``(plain model input, {loss input name: array})`` (:func:`model_input_to_plain`)."""
    return [(model_input_to_plain(d.model_input), {k: v.array for k, v in d.loss_fn_inputs.items()}) for d in data]


def datums_from_plain(items: Sequence[tuple[tuple, dict[str, np.ndarray]]]) -> list[Datum]:
    return [
        Datum(model_input=model_input_from_plain(plain), loss_fn_inputs={k: TensorData(v) for k, v in inputs.items()})
        for plain, inputs in items
    ]


def sample_request_to_plain(request: SampleRequest) -> dict[str, Any]:
    """A :class:`~skyrl_sdk.types.SampleRequest` as its fields: the prompts as
    :func:`model_input_to_plain` gives them (a prompt's prepared images travel as their
    pixels), ``sampling_params`` as its fields, the rest as they are (numbers, flags, arrays)."""
    plain = {f.name: getattr(request, f.name) for f in attrs.fields(SampleRequest)}
    plain["prompts"] = [model_input_to_plain(p) if isinstance(p, ModelInput) else (p,) for p in request.prompts]
    plain["sampling_params"] = attrs.asdict(request.sampling_params)
    return plain


def sample_request_from_plain(plain: Mapping[str, Any]) -> SampleRequest:
    """The request :func:`sample_request_to_plain` describes (checked again as it is built)."""
    prompts = [model_input_from_plain(p) if len(p) > 1 else np.asarray(p[0], dtype=np.int64)
               for p in plain["prompts"]]
    return SampleRequest(**{**plain, "prompts": prompts, "sampling_params": SamplingParams(**plain["sampling_params"])})
