"""What the public API accepts, turned into our types, or refused by name.

Each entry point accepts exactly: our own type, a mapping (Tinker's JSON shape), or an
object that carries the type's fields (the official ``tinker.types``, duck-typed: tinker
is never imported). Anything else is a ``TypeError`` naming the type received; it is never
read as "all defaults". A key the type does not have is refused by name
(:func:`~skyrl_sdk.errors.refuse_unknown_keys`), however it came: the server reads its
JSON and protobuf bodies through these same functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import AdamParamsError, DatumError, InputError, refuse_unknown_keys
from ..types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams
from ..types.model_input import model_input_from_any
from .tinker_json import datum_from_json


def fields_of(obj: Any, cls: type, what: str, primary: str) -> dict[str, Any]:
    """The fields an object carries (``None``: not given): a mapping, a pydantic model
    (``tinker.types``), a dataclass, or else the attributes ``cls`` has (``primary`` required)."""
    if isinstance(obj, Mapping):
        return dict(obj)
    if callable(getattr(obj, "model_dump", None)):  # tinker's pydantic types: every field they carry
        return obj.model_dump(exclude_none=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # tinker's Datum
        return {f.name: v for f in dataclasses.fields(obj) if (v := getattr(obj, f.name)) is not None}
    if hasattr(obj, primary) and not isinstance(obj, (str, bytes, int, float)):
        return {f.name: getattr(obj, f.name) for f in attrs.fields(cls) if hasattr(obj, f.name)}
    raise TypeError(
        f"{what}: expected {cls.__name__}, a mapping or an object with its fields, got {type(obj).__name__}"
    )


def _build(cls: type, fields: dict[str, Any], what: str, error_cls: type[InputError]) -> Any:
    """``cls(**fields)`` with unknown keys refused by name; ``None`` values take the default."""
    refuse_unknown_keys(what, fields, [f.name for f in attrs.fields(cls)], error_cls)
    try:
        return cls(**{k: v for k, v in fields.items() if v is not None})
    except InputError:
        raise
    except (TypeError, ValueError) as exc:
        raise error_cls(f"{what}: {exc}") from None


def adam_params_from_any(obj: Any) -> AdamParams:
    """AdamParams from ours, a mapping, or a duck-typed ``tinker.types.AdamParams``."""
    if isinstance(obj, AdamParams):
        return obj
    return _build(AdamParams, fields_of(obj, AdamParams, "adam_params", "learning_rate"), "AdamParams",
                  AdamParamsError)


def lora_config_from_any(obj: Any) -> LoraConfig | None:
    """LoraConfig from ours, a mapping, or a duck-typed ``tinker.types.LoraConfig`` (None = full fine-tuning)."""
    if obj is None or isinstance(obj, LoraConfig):
        return obj
    return _build(LoraConfig, fields_of(obj, LoraConfig, "lora", "rank"), "LoraConfig", InputError)


def sampling_params_from_any(obj: Any) -> SamplingParams:
    """SamplingParams from ours, a mapping, or a duck-typed ``tinker.types.SamplingParams`` (None = defaults)."""
    if obj is None:
        return SamplingParams()
    if isinstance(obj, SamplingParams):
        return obj
    return _build(SamplingParams, fields_of(obj, SamplingParams, "sampling_params", "max_tokens"),
                  "SamplingParams", InputError)


def datum_from_any(obj: Any) -> Datum:
    """A skyrl Datum, a Tinker-JSON dict, or a duck-typed ``tinker.types.Datum``."""
    if isinstance(obj, Datum):
        return obj
    if isinstance(obj, Mapping):
        return datum_from_json(obj)
    if callable(getattr(obj, "model_dump", None)):  # a pydantic Datum: its JSON shape
        return datum_from_json(obj.model_dump(exclude_none=True))
    if hasattr(obj, "model_input") and hasattr(obj, "loss_fn_inputs"):
        return _build(Datum, fields_of(obj, Datum, "Datum", "model_input"), "Datum", InputError)
    raise TypeError(f"expected a Datum, a mapping or a tinker Datum, got {type(obj).__name__}")


def _is_list_like(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, Mapping))


def data_from_any(data: Any) -> list[Datum]:
    """A non-empty list of whatever :func:`datum_from_any` takes; errors name the datum index."""
    if not _is_list_like(data):
        raise InputError(f"data must be a list of Datum, got {type(data).__name__}")
    if len(data) == 0:
        raise InputError("data is empty: forward_backward needs at least one Datum")
    out = []
    for i, d in enumerate(data):
        try:
            out.append(datum_from_any(d))
        except DatumError:
            raise
        except (InputError, TypeError, ValueError, KeyError) as exc:
            raise DatumError(f"not a valid Datum: {exc}", index=i) from None
    return out


def prompts_from_any(prompts: Any) -> list[np.ndarray | ModelInput]:
    """A non-empty list of prompts, each a ModelInput (ours or tinker's) or a flat list of token ids:
    each made its token ids, or kept a ``ModelInput`` when it holds images (the model's image
    processor reads them next)."""
    if isinstance(prompts, ModelInput) or hasattr(prompts, "chunks"):
        raise InputError("prompts: expected a list of prompts, got a single ModelInput (wrap it in a list)")
    if not _is_list_like(prompts) and not isinstance(prompts, np.ndarray):
        raise InputError(f"prompts: expected a list of ModelInput or token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise InputError("prompts is empty")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise InputError(f"prompt {i}: expected a ModelInput or a list of token ids, got a string "
                             f"(encode it with backend.tokenizer first)")
        try:
            model_input = model_input_from_any(prompt)
            tokens = model_input if model_input.has_images else model_input.to_numpy()
        except InputError as exc:
            raise InputError(f"prompt {i}: {exc}") from None
        if len(model_input.chunks) == 0 or (isinstance(tokens, np.ndarray) and tokens.size == 0):
            raise InputError(f"prompt {i}: expected at least one token")
        out.append(tokens)
    return out
