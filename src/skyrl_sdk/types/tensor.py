"""``TensorData``: the numpy-backed tensor of every ``loss_fn_inputs`` and output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InputError
from .arrays import TensorDtype, as_numpy, densify_csr

#: loss_fn_inputs keys whose tensors are integer token ids; every other key is float32.
INTEGER_KEYS = frozenset({"target_tokens"})


def dtype_for_key(key: str) -> TensorDtype:
    """The dtype a loss_fn_inputs tensor is stored with (Tinker's rule: by key)."""
    return "int64" if key in INTEGER_KEYS else "float32"


@attrs.frozen(eq=False)
class TensorData:
    """A numpy-backed tensor with Tinker's dtype vocabulary (``int64`` or ``float32``)."""

    #: The values; stored as int64 (integer kinds) or float32 (everything else).
    array: np.ndarray = attrs.field()

    def __attrs_post_init__(self) -> None:
        # the same rule as every other input path (``as_numpy``): nothing is silently coerced
        if not isinstance(self.array, np.ndarray):
            raise TypeError(f"TensorData.array: expected a numpy array, got {type(self.array).__name__}")
        if self.array.dtype.kind == "b":
            raise InputError("TensorData.array: got booleans; give int64 ids or float32 values "
                             "(e.g. mask.astype(np.float32) for weights)")
        if self.array.dtype not in (np.int64, np.float32):
            dtype: TensorDtype = "int64" if self.array.dtype.kind in "iu" else "float32"
            object.__setattr__(self, "array", as_numpy(self.array, dtype, "TensorData.array"))

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
        return cls(as_numpy(array, dtype, "TensorData"))

    @classmethod
    def from_torch(cls, tensor: Any, dtype: TensorDtype | None = None) -> TensorData:
        if dtype is None:
            dtype = "float32" if tensor.is_floating_point() else "int64"
        return cls(as_numpy(tensor, dtype, "TensorData"))

    @classmethod
    def from_list(
        cls, data: Sequence[Any], dtype: TensorDtype = "float32", shape: Sequence[int] | None = None
    ) -> TensorData:
        array = as_numpy(data, dtype, "TensorData")
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
    if getattr(value, "sparse_crow_indices", None) is not None:  # tinker's CSR form: ``data`` holds the values
        return TensorData.from_sparse_csr(
            value.data, value.sparse_crow_indices, value.sparse_col_indices, value.shape, dtype,
        )
    return TensorData(as_numpy(value, dtype, what or f"loss_fn_inputs[{key!r}]"))
