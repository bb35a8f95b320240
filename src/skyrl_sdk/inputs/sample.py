"""A sample call, typed once: ``Backend.sample`` and the server's ``asample`` both build it
here, so both accept and refuse the same things with the same messages (the server adds its
bounds on ``num_samples`` and ``topk_prompt_logprobs``).

A new option of the call goes here, in one place: a field of :class:`SampleCall`, a
parameter of :func:`sample_call` and its key in :data:`CALL_KEYS` (then the server reads it
from Tinker's JSON ``SampleRequest`` by the same name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InputError, quoted, refuse_unknown_keys
from ..types import ImageChunk, ModelInput, SamplingParams
from ..types.arrays import as_numpy
from ..types.numbers import check_number, check_sample_counts
from .coerce import prompts_from_any, sampling_params_from_any
from .tinker_json import TENSOR_KEYS, model_input_from_json

#: the keys of Tinker's JSON ``SampleRequest`` that are arguments of :func:`sample_call`
#: by the same name (``prompt``, one prompt, is read apart)
CALL_KEYS = ("sampling_params", "num_samples", "prompt_logprobs", "topk_prompt_logprobs", "record_stability_info",
             "topk_sample_logprobs", "prompt_alt_tokens_k")
#: most token ids a ``target_prompt_logprobs`` row may name (its K)
MAX_TARGET_PROMPT_IDS = 1024


@attrs.frozen(eq=False)
class SampleCall:
    """One sample call's checked values."""

    #: each prompt's token ids (1-D int64, at least one token), or its ``ModelInput`` when it
    #: holds images (the model's image processor reads them before compute)
    prompts: tuple[np.ndarray | ModelInput, ...]
    sampling_params: SamplingParams
    #: continuations per prompt (>= 1)
    num_samples: int = 1
    #: whether each prompt token's logprob is returned too
    prompt_logprobs: bool = False
    #: per prompt position, this many most likely (token, logprob) pairs (0: none)
    topk_prompt_logprobs: int = 0
    #: whether every sampled sequence is recorded for ``stable_reinforce`` (and gets a sequence_id)
    record_stability_info: bool = False
    #: per sampled position, this many most likely (token, logprob) pairs (0: none)
    topk_sample_logprobs: int = 0
    #: per prompt, an int64 ``[len(prompt) - 1, K]`` array of token ids to score (-1: none), or None
    target_prompt_logprobs: tuple[np.ndarray | None, ...] | None = None
    #: draws at every prompt position after the first (0: none)
    prompt_alt_tokens_k: int = 0

    def scores(self) -> dict[str, Any]:
        """Tinker's other scores asked for (the sampler's keyword arguments; none by default)."""
        asked = {"topk_sample_logprobs": self.topk_sample_logprobs, "prompt_alt_tokens_k": self.prompt_alt_tokens_k,
                 "target_prompt_logprobs": self.target_prompt_logprobs}
        return {k: (list(v) if k == "target_prompt_logprobs" else v) for k, v in asked.items() if v}


def sample_call(prompts: Any, sampling_params: Any = None, num_samples: Any = 1, prompt_logprobs: Any = False,
                   topk_prompt_logprobs: Any = 0, record_stability_info: Any = False, topk_sample_logprobs: Any = 0,
                   target_prompt_logprobs: Any = None, prompt_alt_tokens_k: Any = 0, *,
                   max_num_samples: int | None = None, max_topk: int | None = None) -> SampleCall:
    """Check a sample call's arguments, the prompts first; values already typed (token-id
    arrays, a ``SamplingParams``) pass through unchanged. ``max_topk`` bounds every width
    (top-k prompt and sample logprobs, alternative draws per position)."""
    arrays = prompts_from_any(prompts)
    num_samples, topk = check_sample_counts(num_samples, topk_prompt_logprobs, max_num_samples=max_num_samples,
                                            max_topk=max_topk)
    params = sampling_params_from_any(sampling_params)
    for name, flag in (("prompt_logprobs", prompt_logprobs), ("record_stability_info", record_stability_info)):
        if not isinstance(flag, bool):
            raise InputError(f"{name}: expected true or false, got {quoted(flag)}")
    widths = [check_number(name, value, low=0, high=max_topk, integer=True) for name, value in
              (("topk_sample_logprobs", topk_sample_logprobs), ("prompt_alt_tokens_k", prompt_alt_tokens_k))]
    targets = _target_ids(arrays, target_prompt_logprobs)
    images = any(not isinstance(p, np.ndarray) for p in arrays)
    for name, asked in (("record_stability_info", record_stability_info), ("prompt_alt_tokens_k", widths[1])):
        if asked and images:
            raise InputError(f"{name}: not available for a prompt with images")
    return SampleCall(tuple(arrays), params, num_samples, prompt_logprobs, topk, record_stability_info,
                         widths[0], targets, widths[1])


def _target_ids(prompts: list[np.ndarray], value: Any) -> tuple[np.ndarray | None, ...] | None:
    """``target_prompt_logprobs``: one entry per prompt, an int64 ``[len(prompt) - 1, K]`` array
    of token ids (-1: none, at least one named) or None. Token ids against the vocabulary are
    the model's to check."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) or not isinstance(value, Sequence) or isinstance(value, (str, bytes)) \
            or len(value) != len(prompts):
        raise InputError(f"target_prompt_logprobs: expected one entry per prompt ({len(prompts)}): an int64 "
                         f"[len(prompt) - 1, K] array of token ids (-1: none), or None")
    out = []
    for i, (prompt, ids) in enumerate(zip(prompts, value, strict=True)):
        where = f"target_prompt_logprobs[{i}]" if len(prompts) > 1 else "target_prompt_logprobs"
        if ids is None:
            out.append(None)
            continue
        if not isinstance(prompt, np.ndarray):
            raise InputError(f"{where}: not available for a prompt with images (its positions are known only "
                             f"once the image processor has read them)")
        ids = as_numpy(ids, "int64", where)
        rows = int(prompt.size) - 1
        if ids.ndim != 2 or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TARGET_PROMPT_IDS:
            raise InputError(f"{where}: expected shape [len(prompt) - 1, K] = [{rows}, K] with 1 <= K <= "
                             f"{MAX_TARGET_PROMPT_IDS}, got {list(ids.shape)}")
        if (ids < -1).any():
            r, c = (int(x) for x in np.argwhere(ids < -1)[0])
            raise InputError(f"{where}[{r}, {c}]: expected a token id or -1 (none), got {int(ids[r, c])}")
        if not (ids >= 0).any():
            raise InputError(f"{where}: names no token id (every cell is -1)")
        out.append(ids)
    return tuple(out) if any(a is not None for a in out) else None


def declared_length(prompt: np.ndarray | ModelInput) -> int:
    """The positions a prompt declares before any image is read: its tokens, and its images'
    ``expected_tokens`` (an image without one counts 0 until the image processor counts it)."""
    if isinstance(prompt, np.ndarray):
        return int(prompt.size)
    return sum(c.length if not isinstance(c, ImageChunk) else c.expected_tokens or 0 for c in prompt.chunks)


def sample_call_from_json(body: Mapping[str, Any], *, max_num_samples: int | None = None,
                             max_topk: int | None = None) -> SampleCall:
    """The call in Tinker's JSON ``SampleRequest`` (one ``prompt``; a key sent as null takes
    its default). The other keys (where to sample from, how to shape the answer) are the
    caller's to read."""
    if "prompt" not in body:
        raise InputError("sample: missing 'prompt'")
    try:
        prompt = model_input_from_json(body["prompt"])
    except InputError as exc:
        raise InputError(f"prompt 0: {exc}") from None
    given = {k: body[k] for k in CALL_KEYS if body.get(k) is not None}
    if body.get("target_prompt_logprobs") is not None:
        given["target_prompt_logprobs"] = [target_ids_from_json(body["target_prompt_logprobs"])]
    return sample_call([prompt], **given, max_num_samples=max_num_samples, max_topk=max_topk)


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
