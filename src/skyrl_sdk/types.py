"""Typed, frozen objects that every skyrl-sdk call takes or returns.

They mirror the official ``tinker.types`` (same field names and defaults) so code written
against Tinker reads the same here. Tensors are numpy-backed (`TensorData`): no
per-element Python loops on the hot path.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, Mapping, Sequence

import attrs
import numpy as np

from .errors import AdamParamsError, DatumError, InputError

TensorDtype = Literal["int64", "float32"]
_NUMPY_DTYPES: dict[str, type] = {"int64": np.int64, "float32": np.float32}
#: loss_fn_inputs keys whose tensors are integer token ids; every other key is float32.
INTEGER_KEYS = frozenset({"target_tokens"})


def dtype_for_key(key: str) -> TensorDtype:
    """The dtype a loss_fn_inputs tensor is stored with (Tinker's rule: by key)."""
    return "int64" if key in INTEGER_KEYS else "float32"


def _as_numpy(value: Any, dtype: TensorDtype, what: str) -> np.ndarray:
    """Convert lists, numpy arrays, torch tensors or TensorData to a numpy array."""
    if isinstance(value, TensorData):
        array = value.array
    elif hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, duck-typed
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        array = tensor.numpy()
    elif hasattr(value, "to_numpy") and hasattr(value, "dtype"):  # tinker.types.TensorData
        array = np.asarray(value.to_numpy())
    else:
        try:
            array = np.asarray(value)
        except ValueError as exc:
            raise InputError(f"{what}: expected a rectangular numeric array ({exc})") from None
    if array.dtype == object:
        raise InputError(f"{what}: expected a rectangular numeric array, got ragged or non-numeric data")
    if array.dtype.kind not in "biuf":
        raise InputError(f"{what}: expected numbers, got dtype {array.dtype}")
    if dtype == "int64" and array.dtype.kind == "f":
        if array.size and not np.all(np.isfinite(array)):
            raise InputError(f"{what}: expected integer token ids, got non-finite values")
        if array.size and not np.all(np.equal(np.floor(array), array)):
            raise InputError(f"{what}: expected integer token ids, got fractional values")
    np_dtype = _NUMPY_DTYPES[dtype]
    if array.dtype != np_dtype:
        array = array.astype(np_dtype)
    return array


def densify_csr(
    values: Any, crow_indices: Sequence[int], col_indices: Sequence[int], shape: Sequence[int],
    dtype: TensorDtype, pad_value: float = 0,
) -> np.ndarray:
    """Densify Tinker's sparse-CSR tensor form (2-D) into a numpy array."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        raise InputError(f"sparse CSR tensor must be 2-D, got shape {list(shape)}")
    crow = np.asarray(crow_indices, dtype=np.int64)
    cols = np.asarray(col_indices, dtype=np.int64)
    vals = np.asarray(values, dtype=_NUMPY_DTYPES[dtype]).reshape(-1)
    rows, ncols = shape
    if crow.shape != (rows + 1,) or crow[0] != 0 or np.any(np.diff(crow) < 0):
        raise InputError(f"sparse CSR crow_indices must be {rows + 1} non-decreasing offsets starting at 0")
    if crow[-1] != len(vals) or len(cols) != len(vals):
        raise InputError(
            f"sparse CSR has {len(vals)} values, {len(cols)} column indices and crow_indices ending at {crow[-1]}"
        )
    if len(cols) and (cols.min() < 0 or cols.max() >= ncols):
        raise InputError(f"sparse CSR column index out of range [0, {ncols})")
    dense = np.full(shape, pad_value, dtype=_NUMPY_DTYPES[dtype])
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_ids, cols] = vals
    return dense


@attrs.frozen(eq=False)
class TensorData:
    """A numpy-backed tensor with Tinker's dtype vocabulary (``int64`` or ``float32``)."""

    array: np.ndarray = attrs.field()

    def __attrs_post_init__(self) -> None:
        if self.array.dtype not in (np.int64, np.float32):
            object.__setattr__(
                self, "array", self.array.astype(np.int64 if self.array.dtype.kind in "biu" else np.float32)
            )

    @property
    def dtype(self) -> TensorDtype:
        return "int64" if self.array.dtype == np.int64 else "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @classmethod
    def from_numpy(cls, array: np.ndarray, dtype: TensorDtype | None = None) -> TensorData:
        array = np.asarray(array)
        if dtype is None:
            dtype = "int64" if array.dtype.kind in "biu" else "float32"
        return cls(_as_numpy(array, dtype, "TensorData"))

    @classmethod
    def from_torch(cls, tensor: Any, dtype: TensorDtype | None = None) -> TensorData:
        if dtype is None:
            dtype = "float32" if tensor.is_floating_point() else "int64"
        return cls(_as_numpy(tensor, dtype, "TensorData"))

    @classmethod
    def from_list(cls, data: Sequence[Any], dtype: TensorDtype = "float32", shape: Sequence[int] | None = None) -> TensorData:
        array = _as_numpy(data, dtype, "TensorData")
        if shape is not None:
            array = array.reshape(tuple(shape))
        return cls(array)

    @classmethod
    def from_sparse_csr(
        cls, values: Any, crow_indices: Sequence[int], col_indices: Sequence[int],
        shape: Sequence[int], dtype: TensorDtype,
    ) -> TensorData:
        return cls(densify_csr(values, crow_indices, col_indices, shape, dtype))

    def to_numpy(self) -> np.ndarray:
        return self.array

    def to_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.array)

    def tolist(self) -> list:
        return self.array.tolist()

    def __len__(self) -> int:
        return self.array.shape[0]


def to_tensor_data(value: Any, key: str, what: str | None = None) -> TensorData:
    """Coerce a list / numpy / torch / TensorData / tinker TensorData by Tinker's key rule."""
    dtype = dtype_for_key(key)
    if isinstance(value, TensorData) and value.dtype == dtype:
        return value
    if getattr(value, "sparse_crow_indices", None) is not None:  # tinker's CSR form
        return TensorData.from_sparse_csr(
            value._numpy if hasattr(value, "_numpy") else value.data,
            value.sparse_crow_indices, value.sparse_col_indices, value.shape, dtype,
        )
    return TensorData(_as_numpy(value, dtype, what or f"loss_fn_inputs[{key!r}]"))


@attrs.frozen(eq=False)
class EncodedTextChunk:
    """A run of token ids."""

    tokens: np.ndarray = attrs.field(converter=lambda t: _as_numpy(t, "int64", "model_input tokens").reshape(-1))
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@attrs.frozen(eq=False)
class ModelInput:
    """The tokens of one sequence, as a list of chunks that concatenate."""

    chunks: tuple[EncodedTextChunk, ...] = attrs.field(converter=tuple)

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


def _coerce_model_input(value: Any) -> ModelInput:
    if isinstance(value, ModelInput):
        return value
    if hasattr(value, "chunks"):  # tinker.types.ModelInput, duck-typed
        chunks = []
        for chunk in value.chunks:
            if not hasattr(chunk, "tokens"):
                raise InputError(
                    f"model_input: only encoded-text chunks are supported, got {type(chunk).__name__}"
                )
            chunks.append(EncodedTextChunk(chunk.tokens))
        return ModelInput(chunks)
    return ModelInput.from_ints(value)


def _coerce_inputs(value: Mapping[str, Any]) -> dict[str, TensorData]:
    return {str(k): to_tensor_data(v, str(k)) for k, v in dict(value).items()}


@attrs.frozen(eq=False)
class Datum:
    """One sequence and the per-position inputs of the loss.

    Position ``i`` of ``model_input`` predicts ``loss_fn_inputs["target_tokens"][i]``.
    """

    model_input: ModelInput = attrs.field(converter=_coerce_model_input)
    loss_fn_inputs: dict[str, TensorData] = attrs.field(factory=dict, converter=_coerce_inputs)


def _check_range(name: str, value: float, low: float | None, high: float | None, *, low_open=False, high_open=True):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdamParamsError(f"AdamParams.{name}: expected a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise AdamParamsError(f"AdamParams.{name}: expected {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value >= high if high_open else value > high):
        raise AdamParamsError(f"AdamParams.{name}: expected {'<' if high_open else '<='} {high}, got {value!r}")


def _real_to_float(value: Any) -> Any:
    """numpy scalars (e.g. a learning rate from a numpy schedule) become plain floats;
    anything else is left for the range check to reject with the field's name."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


@attrs.frozen
class AdamParams:
    """AdamW hyper-parameters of one optim_step; Tinker's names and defaults. All are honoured."""

    learning_rate: float = attrs.field(default=1e-4, converter=_real_to_float)
    beta1: float = attrs.field(default=0.9, converter=_real_to_float)
    beta2: float = attrs.field(default=0.95, converter=_real_to_float)
    eps: float = attrs.field(default=1e-12, converter=_real_to_float)
    weight_decay: float = attrs.field(default=0.0, converter=_real_to_float)
    grad_clip_norm: float = attrs.field(default=0.0, converter=_real_to_float)  # 0 = no clipping

    def __attrs_post_init__(self) -> None:
        _check_range("learning_rate", self.learning_rate, 0.0, None)
        _check_range("beta1", self.beta1, 0.0, 1.0)
        _check_range("beta2", self.beta2, 0.0, 1.0)
        _check_range("eps", self.eps, 0.0, None, low_open=True)
        _check_range("weight_decay", self.weight_decay, 0.0, None)
        _check_range("grad_clip_norm", self.grad_clip_norm, 0.0, None)


def _positive_int(instance, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"LoraConfig.{attribute.name}: expected a positive integer, got {value!r}")


def _positive_number(instance, attribute, value):
    if not _is_finite_number(value) or value <= 0:
        raise InputError(f"LoraConfig.{attribute.name}: expected a finite number > 0, got {value!r}")


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@attrs.frozen
class LoraConfig:
    """LoRA adapters (trained with peft). ``alpha`` defaults to 32 like Tinker."""

    rank: int = attrs.field(default=8, validator=_positive_int)
    alpha: float = attrs.field(default=32.0, validator=_positive_number)
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def __attrs_post_init__(self) -> None:
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise InputError("LoraConfig: at least one of train_mlp, train_attn, train_unembed must be true")


@attrs.frozen
class SamplingParams:
    """How to sample: Tinker's fields."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[int | str, ...] = attrs.field(default=(), converter=lambda s: tuple(s or ()))

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"SamplingParams.max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"SamplingParams.temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise InputError(f"SamplingParams.top_p: expected 0 < top_p <= 1, got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise InputError(f"SamplingParams.top_k: expected -1 (off) or a positive integer, got {self.top_k!r}")


@attrs.frozen(eq=False)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


@attrs.frozen(eq=False)
class SampleOutput:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@attrs.frozen(eq=False)
class ForwardBackwardOutput:
    """Result of forward / forward_backward.

    ``loss_fn_outputs[i]`` belongs to ``data[i]`` (caller's order) and maps names such as
    ``logprobs`` to TensorData; ``metrics`` keys have the form ``name:reduction``.
    """

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


@attrs.frozen
class OptimStepOutput:
    metrics: dict[str, float]


@attrs.frozen
class SaveWeightsForSamplerOutput:
    path: str


@attrs.frozen
class SaveStateOutput:
    path: str


@attrs.frozen
class LoadStateOutput:
    path: str
    optimizer_loaded: bool


@attrs.frozen
class ModelInfo:
    model_name: str
    architecture: str
    vocab_size: int
    tokenizer_dir: str | None
    is_lora: bool
    lora_rank: int | None
    role: str
    engine: str
    num_parameters: int
    num_trainable_parameters: int
