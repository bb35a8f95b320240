"""Numeric arrays from whatever a caller sends: lists, numpy, torch, tinker tensors, CSR.

Shared by the public types and the server's wire path, so both accept and reject the same
things with the same messages. No per-element Python loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ..errors import InputError

TensorDtype = Literal["int64", "float32"]
NUMPY_DTYPES: dict[str, type] = {"int64": np.int64, "float32": np.float32}


def as_numpy(value: Any, dtype: TensorDtype, what: str) -> np.ndarray:
    """Convert lists, numpy arrays, torch tensors or (tinker) TensorData to ``dtype``."""
    if hasattr(value, "array") and isinstance(getattr(value, "array", None), np.ndarray):  # our TensorData
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
        except (ValueError, TypeError, OverflowError) as exc:
            raise InputError(f"{what}: expected a rectangular numeric array ({exc})") from None
    check_numeric(array, dtype, what)
    np_dtype = NUMPY_DTYPES[dtype]
    if array.dtype != np_dtype:
        with np.errstate(over="ignore"):  # float64 beyond float32 becomes inf; finiteness checks name it
            array = array.astype(np_dtype)
    return array


def check_numeric(array: np.ndarray, dtype: TensorDtype, what: str) -> None:
    """Whether ``array`` converts to ``dtype`` without changing meaning; raise :class:`InputError`.

    The one rule every input path applies (``as_numpy``, and ``TensorData`` however it is
    built): real numbers only (no objects, strings, dates, complex); ids (``int64``) are
    integers, not bools, and fit int64 (a uint64 ``2**64 - 1`` would wrap to ``-1``).
    """
    if array.dtype == object:
        raise InputError(f"{what}: expected a rectangular numeric array, got ragged or non-numeric data")
    if array.dtype.kind not in "biuf":
        raise InputError(f"{what}: expected numbers, got dtype {array.dtype}")
    if dtype == "int64" and array.dtype.kind == "b":
        raise InputError(f"{what}: expected integer token ids, got booleans")
    if dtype == "int64" and array.dtype.kind == "f":
        if array.size and not np.all(np.isfinite(array)):
            raise InputError(f"{what}: expected integer token ids, got non-finite values")
        if array.size and not np.all(np.equal(np.floor(array), array)):
            raise InputError(f"{what}: expected integer token ids, got fractional values")
        if array.size and np.abs(array).max() >= 2**63:
            raise InputError(f"{what}: expected integer token ids, got values beyond int64")
    if dtype == "int64" and array.dtype.kind == "u" and array.size and array.max() >= 2**63:
        raise InputError(f"{what}: expected integer token ids, got values beyond int64")


def densify_csr(
    values: Any, crow_indices: Sequence[int] | np.ndarray, col_indices: Sequence[int] | np.ndarray,
    shape: Sequence[int], dtype: TensorDtype, pad_value: float = 0, *, max_elements: int | None = None,
) -> np.ndarray:
    """Densify Tinker's sparse-CSR tensor form (2-D) into a numpy array.

    ``max_elements`` bounds the dense size *before* anything is allocated (a small body may
    declare a huge shape).
    """
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise InputError(f"sparse CSR shape must be a list of integers, got {shape!r}") from None
    if len(shape) != 2 or min(shape) < 0:
        raise InputError(f"sparse CSR tensor must be 2-D with non-negative sizes, got shape {list(shape)}")
    rows, ncols = shape
    if max_elements is not None and rows * ncols > max_elements:
        raise InputError(f"sparse CSR shape {list(shape)} has {rows * ncols} elements; the limit is {max_elements}")
    crow = as_numpy(crow_indices, "int64", "sparse CSR crow_indices").reshape(-1)
    cols = as_numpy(col_indices, "int64", "sparse CSR col_indices").reshape(-1)
    vals = as_numpy(values, dtype, "sparse CSR values").reshape(-1)
    if crow.shape != (rows + 1,) or crow[0] != 0 or np.any(np.diff(crow) < 0):
        raise InputError(f"sparse CSR crow_indices must be {rows + 1} non-decreasing offsets starting at 0")
    if crow[-1] != len(vals) or len(cols) != len(vals):
        raise InputError(
            f"sparse CSR has {len(vals)} values, {len(cols)} column indices and crow_indices ending at {crow[-1]}"
        )
    if len(cols) and (cols.min() < 0 or cols.max() >= ncols):
        raise InputError(f"sparse CSR column index out of range [0, {ncols})")
    dense: np.ndarray = np.full(shape, pad_value, dtype=NUMPY_DTYPES[dtype])
    row_ids = np.repeat(np.arange(rows), np.diff(crow))
    dense[row_ids, cols] = vals
    return dense
