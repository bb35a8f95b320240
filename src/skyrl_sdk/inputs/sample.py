"""A sample call's arguments, made the one :class:`~skyrl_sdk.types.SampleRequest`:
``Backend.sample`` and the server's ``asample`` both build it here, so both accept and refuse
the same things with the same messages (the server adds its bounds on ``num_samples`` and the
top-k widths).

The options are the request's fields: :data:`OPTION_KEYS` (its fields but ``prompts``) are
the keyword arguments :func:`sample_request_from_any` takes and the keys read from Tinker's
JSON ``SampleRequest``, so a new option is a new field of ``SampleRequest`` and nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InputError, quoted, refuse_unknown_keys
from ..types import ImageChunk, ModelInput, SampleRequest
from ..types.arrays import as_numpy
from ..types.numbers import check_number
from ..types.sample_request import MAX_TARGET_PROMPT_IDS, WIDTHS
from .coerce import prompts_from_any, sampling_params_from_any
from .tinker_json import TENSOR_KEYS, model_input_from_json

#: a sample call's options: every field of ``SampleRequest`` but its prompts (Tinker's JSON
#: ``SampleRequest`` has them by the same names; it has one ``prompt``)
OPTION_KEYS = tuple(f.name for f in attrs.fields(SampleRequest) if f.name != "prompts")


def sample_request_from_any(prompts: Any, sampling_params: Any = None, *, max_num_samples: int | None = None,
                            max_topk: int | None = None, **options: Any) -> SampleRequest:
    """Check a sample call's arguments, the prompts first: ``prompts`` and ``sampling_params``
    as :mod:`.coerce` reads them (values already typed pass through unchanged), ``options`` by
    the names of :data:`OPTION_KEYS`. ``max_num_samples`` and ``max_topk`` (every width: top-k
    prompt and sample logprobs, alternative draws per position) are the caller's bounds."""
    refuse_unknown_keys("sample", options, OPTION_KEYS)
    arrays = prompts_from_any(prompts)
    bounds = {"num_samples": (1, max_num_samples), **{w: (0, max_topk) for w in WIDTHS}}
    for name, (low, high) in bounds.items():
        if high is not None and name in options:
            check_number(name, options[name], low=low, high=high, integer=True)
    if "target_prompt_logprobs" in options:
        options["target_prompt_logprobs"] = _target_ids(arrays, options["target_prompt_logprobs"])
    return SampleRequest(prompts=arrays, sampling_params=sampling_params_from_any(sampling_params), **options)


def _target_ids(prompts: list[np.ndarray | ModelInput], value: Any) -> tuple[np.ndarray | None, ...] | None:
    """``target_prompt_logprobs`` as the request holds it: one entry per prompt, each made an
    int64 array (or None); None when no entry names ids. The request checks the rest."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) or not isinstance(value, Sequence) or isinstance(value, (str, bytes)) \
            or len(value) != len(prompts):
        raise InputError(f"target_prompt_logprobs: expected one entry per prompt ({len(prompts)}): an int64 "
                         f"[len(prompt) - 1, K] array of token ids (-1: none), or None")
    out = []
    for i, (prompt, ids) in enumerate(zip(prompts, value, strict=True)):
        where = f"target_prompt_logprobs[{i}]" if len(prompts) > 1 else "target_prompt_logprobs"
        if ids is not None and isinstance(prompt, ModelInput):
            raise InputError(f"{where}: not available for a prompt with images (its positions are known only "
                             f"once the image processor has read them)")
        out.append(None if ids is None else as_numpy(ids, "int64", where))
    return tuple(out) if any(a is not None for a in out) else None


def declared_length(prompt: np.ndarray | ModelInput) -> int:
    """The positions a prompt declares before any image is read: its tokens, and its images'
    ``expected_tokens`` (an image without one counts 0 until the image processor counts it)."""
    if isinstance(prompt, np.ndarray):
        return int(prompt.size)
    return sum(c.length if not isinstance(c, ImageChunk) else c.expected_tokens or 0 for c in prompt.chunks)


def sample_request_from_json(body: Mapping[str, Any], *, max_num_samples: int | None = None,
                             max_topk: int | None = None) -> SampleRequest:
    """The call in Tinker's JSON ``SampleRequest`` (one ``prompt``; a key sent as null takes
    its default). The other keys (where to sample from, how to shape the answer) are the
    caller's to read."""
    if "prompt" not in body:
        raise InputError("sample: missing 'prompt'")
    try:
        prompt = model_input_from_json(body["prompt"])
    except InputError as exc:
        raise InputError(f"prompt 0: {exc}") from None
    given = {k: body[k] for k in OPTION_KEYS if body.get(k) is not None}
    if "target_prompt_logprobs" in given:
        given["target_prompt_logprobs"] = [target_ids_from_json(given["target_prompt_logprobs"])]
    return sample_request_from_any([prompt], max_num_samples=max_num_samples, max_topk=max_topk, **given)


def target_ids_from_json(obj: Any) -> np.ndarray:
    """Tinker's ``target_prompt_logprobs`` tensor (JSON ``TensorData``, dense or sparse CSR;
    a cell a sparse tensor leaves out is -1, as the client's ``from_torch_sparse(ids,
    pad_value=-1)`` means it)."""
    what = "target_prompt_logprobs"
    if not isinstance(obj, Mapping):
        raise InputError(f"{what}: expected a TensorData object, got {type(obj).__name__}")
    refuse_unknown_keys(what, obj, TENSOR_KEYS)
    if obj.get("dtype") != "int64":
        raise InputError(f"{what}: expected an int64 tensor of token ids, got dtype {quoted(obj.get('dtype'))}")
    shape = obj.get("shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise InputError(f"{what}: expected a 2-D shape [len(prompt) - 1, K], got {quoted(shape)}")
    rows, cols = (check_number(f"{what}.shape", n, low=0, high=MAX_TARGET_PROMPT_IDS * 2**20, integer=True)
                  for n in shape)
    values = as_numpy(obj.get("data", []), "int64", f"{what}.data").reshape(-1)
    if obj.get("sparse_crow_indices") is None:
        if values.size != rows * cols:
            raise InputError(f"{what}: shape {shape} needs {rows * cols} values, got {values.size}")
        return values.reshape(rows, cols)
    crow = as_numpy(obj["sparse_crow_indices"], "int64", f"{what}.sparse_crow_indices")
    col = as_numpy(obj.get("sparse_col_indices", []), "int64", f"{what}.sparse_col_indices")
    if crow.shape != (rows + 1,) or crow[0] != 0 or (np.diff(crow) < 0).any() or crow[-1] != values.size \
            or col.shape != values.shape or ((col < 0) | (col >= cols)).any():
        raise InputError(f"{what}: sparse CSR indices do not describe a {rows} x {cols} tensor of {values.size} values")
    dense = np.full((rows, cols), -1, dtype=np.int64)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense
