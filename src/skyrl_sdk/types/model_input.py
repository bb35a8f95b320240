"""``ModelInput``: the tokens of one sequence, as Tinker's list of chunks.

A chunk is a run of token ids (``EncodedTextChunk``) or an image (``ImageChunk``: the
encoded bytes a client sends, as Tinker's). An image takes ``expected_tokens`` positions of
the sequence, as Tinker counts them, so that ``loss_fn_inputs`` align with the sequence the
model reads; a vision-language model's image processor turns it into a
``PreparedImageChunk`` (its patches, and the placeholder token at each of its positions)
before anything is computed (``skyrl_sdk.models.images``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from ..errors import InputError, quoted, refuse_unknown_keys
from .arrays import as_numpy


def _integer_items(items: Sequence[Any]) -> bool:
    """Whether every item is an integer (not a bool) or a list (left to the shape check). By
    the items' types (one C-level pass, then a check per distinct type: 131k tokens in ~3 ms,
    against ~60 ms for ``isinstance(t, numbers.Integral)`` item by item)."""
    kinds = set(map(type, items))
    return kinds <= {int} or (bool not in kinds and all(issubclass(k, (numbers.Integral, list, tuple))
                                                        for k in kinds))


def _token_vector(tokens: Any) -> np.ndarray:
    """A 1-D int64 vector; a nested list is refused rather than flattened, and a list (what
    JSON gives) must hold integers (``1.5``, ``true`` or ``"7"`` is not a token id, even
    where numpy would convert it)."""
    if tokens is None or isinstance(tokens, (str, bytes, Mapping)) or (
            isinstance(tokens, (list, tuple)) and not _integer_items(tokens)):
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
    #: Tinker's chunk type tag.
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


#: The encodings Tinker's image chunks name.
ImageFormat = Literal["png", "jpeg"]
IMAGE_FORMATS: tuple[ImageFormat, ...] = ("png", "jpeg")


def _image_bytes(value: Any) -> bytes:
    """The encoded image: bytes, or (Tinker's JSON) their base64 text."""
    if isinstance(value, str):
        try:
            value = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"image chunk data: not valid base64 ({len(value)} characters)") from None
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise InputError(f"image chunk data: expected the encoded image as bytes or base64 text, "
                         f"got {type(value).__name__}")
    if not value:
        raise InputError("image chunk data: empty")
    return value


def _image_format(instance: Any, attribute: Any, value: Any) -> None:
    if value not in IMAGE_FORMATS:
        raise InputError(f"image chunk format: expected one of {list(IMAGE_FORMATS)}, got {value!r}")


def _expected_tokens(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InputError(f"image chunk expected_tokens: expected a positive integer or null, got {value!r}")


@attrs.frozen(eq=False)
class ImageChunk:
    """An image as Tinker sends it: the encoded bytes and the positions it takes."""

    #: The encoded image (PNG or JPEG bytes).
    data: bytes = attrs.field(converter=_image_bytes, repr=lambda b: f"<{len(b)} bytes>")
    #: ``"png"`` or ``"jpeg"``.
    format: ImageFormat = attrs.field(validator=_image_format)
    #: How many positions the image takes in the sequence (Tinker's count; ``None``: the
    #: model's image processor counts them before anything is computed, and a given count
    #: that differs from its count is refused).
    expected_tokens: int | None = attrs.field(default=None, validator=_expected_tokens)
    #: Tinker's chunk type tag.
    type: Literal["image"] = "image"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise InputError("image chunk: expected_tokens is not set, so its length is known only once the "
                             "model's image processor has read it")
        return self.expected_tokens


@attrs.frozen(eq=False)
class PreparedImageChunk:
    """An image as a vision-language model reads it: its patches, their grid, and the
    placeholder token the model replaces by the image's features at each of its positions."""

    #: The processor's patches, float32 (patches, channels x temporal x patch x patch).
    pixel_values: np.ndarray
    #: The patch grid (temporal, height, width).
    grid_thw: tuple[int, int, int]
    #: Patches merged into one position along each spatial axis.
    merge_size: int
    #: The model's image placeholder token (``<|image_pad|>``).
    token_id: int
    #: sha256 of the encoded image: equal images are the same input (sampling dedups prompts on it).
    digest: str
    #: The chunk type tag (ours: Tinker has no prepared images).
    type: Literal["prepared_image"] = "prepared_image"

    @property
    def length(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2

    @property
    def tokens(self) -> np.ndarray:
        return np.full(self.length, self.token_id, dtype=np.int64)

    @staticmethod
    def digest_of(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()


Chunk = EncodedTextChunk | ImageChunk | PreparedImageChunk

#: Chunk classes by Tinker's ``type`` tag. The one place a new kind of chunk is added: its
#: class above (attrs, Tinker's field names, checking its own values) and its tag here; JSON,
#: duck-typed ``tinker.types`` chunks and protobuf chunks are all read through this table
#: (:func:`chunk_from_fields`; protobuf bytes are decoded to these fields in
#: ``skyrl_sdk.inputs.tinker_proto``).
CHUNK_TYPES: dict[str, type] = {"encoded_text": EncodedTextChunk, "image": ImageChunk}
#: Tinker's chunk types refused by name, and why.
REFUSED_CHUNK_TYPES = {
    "image_asset_pointer": "nothing reads a path or a URL for a caller: send the image's bytes as an 'image' chunk",
}
#: The tag a chunk without one has (Tinker's default).
DEFAULT_CHUNK_TYPE = "encoded_text"


def _chunk_class(kind: Any, what: str) -> type:
    cls = CHUNK_TYPES.get(kind) if isinstance(kind, str) else None
    if isinstance(kind, str) and kind in REFUSED_CHUNK_TYPES:
        raise InputError(f"{what}: {kind!r} chunks are not served ({REFUSED_CHUNK_TYPES[kind]})")
    if cls is None:
        raise InputError(f"{what}: chunks of type {quoted(kind)} are not supported; supported types: "
                         f"{sorted(CHUNK_TYPES)}")
    return cls


@functools.cache
def _field_names(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """(every field, the required ones) of an attrs class."""
    fields = attrs.fields(cls)
    return tuple(f.name for f in fields), frozenset(f.name for f in fields if f.default is attrs.NOTHING)


def chunk_from_fields(fields: Mapping[str, Any], what: str = "model_input.chunks[0]") -> Any:
    """A chunk from its fields (a JSON object, or the fields of a decoded protobuf chunk): its
    ``type`` picks the class in :data:`CHUNK_TYPES`; unknown keys are refused by name."""
    kind = fields.get("type", DEFAULT_CHUNK_TYPE)
    cls = _chunk_class(kind, what)
    names, required = _field_names(cls)
    refuse_unknown_keys(f"{what} ({kind})", fields, names)
    if not required <= fields.keys():
        raise InputError(f"{what} ({kind}): missing {sorted(required - fields.keys())}")
    try:
        return cls(**fields)
    except InputError as exc:
        raise InputError(f"{what}: {exc}") from None


def _chunk_of(chunk: Any, what: str) -> Any:
    """Ours, or a duck-typed chunk (``tinker.types.EncodedTextChunk``...) read through its tag."""
    if isinstance(chunk, (*CHUNK_TYPES.values(), PreparedImageChunk)):
        return chunk
    kind = getattr(chunk, "type", DEFAULT_CHUNK_TYPE if hasattr(chunk, "tokens") else type(chunk).__name__)
    cls = _chunk_class(kind, what)
    return cls(**{name: getattr(chunk, name) for name in _field_names(cls)[0] if hasattr(chunk, name)})


def _chunks(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"model_input.chunks: expected a list of chunks, got {type(value).__name__}")
    return tuple(_chunk_of(chunk, f"model_input.chunks[{j}]") for j, chunk in enumerate(value))


@attrs.frozen(eq=False)
class ModelInput:
    """The tokens of one sequence, as a list of chunks that concatenate."""

    #: The chunks, in order; their positions concatenate into the sequence.
    chunks: tuple[Chunk, ...] = attrs.field(converter=_chunks)

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | np.ndarray) -> ModelInput:
        return cls((EncodedTextChunk(tokens),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(())

    def append(self, chunk: Chunk) -> ModelInput:
        return ModelInput((*self.chunks, chunk))

    def append_int(self, token: int) -> ModelInput:
        if self.has_images:
            return self.append(EncodedTextChunk([token]))
        return ModelInput.from_ints(np.concatenate([self.to_numpy(), np.array([token], dtype=np.int64)]))

    @property
    def has_images(self) -> bool:
        return any(not isinstance(c, EncodedTextChunk) for c in self.chunks)

    @property
    def images(self) -> tuple[ImageChunk | PreparedImageChunk, ...]:
        return tuple(c for c in self.chunks if not isinstance(c, EncodedTextChunk))

    def to_numpy(self) -> np.ndarray:
        """The token ids the model reads: a prepared image's positions hold its placeholder token.
        An image no model has read yet has no token ids (an ``InputError``)."""
        if len(self.chunks) == 1 and isinstance(self.chunks[0], EncodedTextChunk):
            return self.chunks[0].tokens
        if not self.chunks:
            return np.zeros(0, dtype=np.int64)
        for j, chunk in enumerate(self.chunks):
            if isinstance(chunk, ImageChunk):
                raise InputError(f"model_input.chunks[{j}] is an image no model has read yet: its token ids are "
                                 f"known only to a vision-language model's image processor")
        return np.concatenate([c.tokens for c in self.chunks if not isinstance(c, ImageChunk)])

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
