"""``ModelInput``: the tokens of one sequence, as Tinker's list of chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from ..errors import InputError
from .arrays import as_numpy


def _token_vector(tokens: Any) -> np.ndarray:
    """A 1-D int64 vector; a nested list is refused rather than flattened."""
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


def _chunks(value: Any) -> tuple[EncodedTextChunk, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"model_input.chunks: expected a list of chunks, got {type(value).__name__}")
    chunks = tuple(value)
    for j, chunk in enumerate(chunks):
        if not isinstance(chunk, EncodedTextChunk):
            raise InputError(f"model_input.chunks[{j}]: expected an EncodedTextChunk, got {type(chunk).__name__}")
    return chunks


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
        chunks = []
        for chunk in value.chunks:
            if not hasattr(chunk, "tokens"):
                raise InputError(f"model_input: only encoded-text chunks are supported, got {type(chunk).__name__}")
            chunks.append(EncodedTextChunk(chunk.tokens))
        return ModelInput(chunks)
    if isinstance(value, (str, bytes, dict)):
        raise InputError(f"model_input: expected a ModelInput or a list of token ids, got {type(value).__name__}")
    return ModelInput.from_ints(value)
