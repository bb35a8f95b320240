"""``ModelInput``: the tokens of one sequence, as Tinker's list of chunks."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from ..errors import InputError, quoted, refuse_unknown_keys
from .arrays import as_numpy


def _token_vector(tokens: Any) -> np.ndarray:
    """A 1-D int64 vector; a nested list is refused rather than flattened, and a list (what
    JSON gives) must hold integers (``1.5``, ``true`` or ``"7"`` is not a token id, even
    where numpy would convert it)."""
    if tokens is None or isinstance(tokens, (str, bytes, Mapping)) or (isinstance(tokens, (list, tuple)) and any(
            isinstance(t, bool) or not isinstance(t, (numbers.Integral, list, tuple)) for t in tokens)):
        raise InputError(f"model_input tokens: expected a flat list of token ids (integers), got {quoted(tokens)}")
    array = as_numpy(tokens, "int64", "model_input tokens")
    if array.ndim != 1:
        raise InputError(f"model_input tokens: expected a flat list of token ids, got shape {list(array.shape)}")
    return array


@attrs.frozen(eq=False)
class EncodedTextChunk:
    """A run of token ids."""

    #: The token ids, a 1-D int64 array.
    tokens: np.ndarray = attrs.field(converter=_token_vector)
    #: Tinker's chunk type tag; only encoded text is supported.
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


#: Chunk classes by Tinker's ``type`` tag. The one place a new kind of chunk is added: its
#: class above (attrs, Tinker's field names, checking its own values) and its tag here; JSON,
#: duck-typed ``tinker.types`` chunks and protobuf chunks are all read through this table
#: (:func:`chunk_from_fields`; protobuf bytes are decoded to these fields in
#: ``skyrl_sdk.inputs.tinker_proto``).
CHUNK_TYPES: dict[str, type] = {"encoded_text": EncodedTextChunk}
#: The tag a chunk without one has (Tinker's default).
DEFAULT_CHUNK_TYPE = "encoded_text"


def _chunk_class(kind: Any, what: str) -> type:
    cls = CHUNK_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InputError(f"{what}: chunks of type {quoted(kind)} are not supported; supported types: "
                         f"{sorted(CHUNK_TYPES)}")
    return cls


def chunk_from_fields(fields: Mapping[str, Any], what: str = "model_input.chunks[0]") -> Any:
    """A chunk from its fields (a JSON object, or the fields of a decoded protobuf chunk): its
    ``type`` picks the class in :data:`CHUNK_TYPES`; unknown keys are refused by name."""
    kind = fields.get("type", DEFAULT_CHUNK_TYPE)
    cls = _chunk_class(kind, what)
    refuse_unknown_keys(f"{what} ({kind})", fields, [f.name for f in attrs.fields(cls)])
    missing = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in fields]
    if missing:
        raise InputError(f"{what} ({kind}): missing {missing}")
    try:
        return cls(**fields)
    except InputError as exc:
        raise InputError(f"{what}: {exc}") from None


def _chunk_of(chunk: Any, what: str) -> Any:
    """Ours, or a duck-typed chunk (``tinker.types.EncodedTextChunk``...) read through its tag."""
    if isinstance(chunk, tuple(CHUNK_TYPES.values())):
        return chunk
    kind = getattr(chunk, "type", DEFAULT_CHUNK_TYPE if hasattr(chunk, "tokens") else type(chunk).__name__)
    cls = _chunk_class(kind, what)
    return cls(**{f.name: getattr(chunk, f.name) for f in attrs.fields(cls) if hasattr(chunk, f.name)})


def _chunks(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"model_input.chunks: expected a list of chunks, got {type(value).__name__}")
    return tuple(_chunk_of(chunk, f"model_input.chunks[{j}]") for j, chunk in enumerate(value))


@attrs.frozen(eq=False)
class ModelInput:
    """The tokens of one sequence, as a list of chunks that concatenate."""

    #: The chunks, in order; their tokens concatenate into the sequence.
    chunks: tuple[EncodedTextChunk, ...] = attrs.field(converter=_chunks)

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | np.ndarray) -> ModelInput:
        return cls((EncodedTextChunk(tokens),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(())

    def append_int(self, token: int) -> ModelInput:
        return ModelInput.from_ints(np.concatenate([self.to_numpy(), np.array([token], dtype=np.int64)]))

    def to_numpy(self) -> np.ndarray:
        if len(self.chunks) == 1:
            return self.chunks[0].tokens
        if not self.chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([c.tokens for c in self.chunks])

    def to_ints(self) -> list[int]:
        return self.to_numpy().tolist()

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)


def model_input_from_any(value: Any) -> ModelInput:
    """Ours, a duck-typed ``tinker.types.ModelInput``, or a flat list/array of token ids."""
    if isinstance(value, ModelInput):
        return value
    if hasattr(value, "chunks"):  # tinker.types.ModelInput, duck-typed
        return ModelInput(value.chunks)
    if isinstance(value, (str, bytes, dict)):
        raise InputError(f"model_input: expected a ModelInput or a list of token ids, got {type(value).__name__}")
    return ModelInput.from_ints(value)
