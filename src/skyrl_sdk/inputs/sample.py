"""A sample call, typed once: ``Backend.sample`` and the server's ``asample`` both build it
here, so both accept and refuse the same things with the same messages (the server adds its
bounds on ``num_samples`` and ``topk_prompt_logprobs``).

A new option of the call goes here, in one place: a field of :class:`SampleRequest`, a
parameter of :func:`sample_request` and its key in :data:`CALL_KEYS` (then the server reads it
from Tinker's JSON ``SampleRequest`` by the same name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ..errors import InputError, quoted
from ..types import ImageChunk, ModelInput, SamplingParams
from ..types.numbers import check_sample_counts
from .coerce import prompts_from_any, sampling_params_from_any
from .tinker_json import model_input_from_json

#: the keys of Tinker's JSON ``SampleRequest`` that are arguments of :func:`sample_request`
#: by the same name (``prompt``, one prompt, is read apart)
CALL_KEYS = ("sampling_params", "num_samples", "prompt_logprobs", "topk_prompt_logprobs")


@attrs.frozen(eq=False)
class SampleRequest:
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


def sample_request(prompts: Any, sampling_params: Any = None, num_samples: Any = 1, prompt_logprobs: Any = False,
                   topk_prompt_logprobs: Any = 0, *, max_num_samples: int | None = None,
                   max_topk: int | None = None) -> SampleRequest:
    """Check a sample call's arguments, the prompts first; values already typed (token-id
    arrays, a ``SamplingParams``) pass through unchanged."""
    arrays = prompts_from_any(prompts)
    num_samples, topk = check_sample_counts(num_samples, topk_prompt_logprobs, max_num_samples=max_num_samples,
                                            max_topk=max_topk)
    params = sampling_params_from_any(sampling_params)
    if not isinstance(prompt_logprobs, bool):
        raise InputError(f"prompt_logprobs: expected true or false, got {quoted(prompt_logprobs)}")
    return SampleRequest(tuple(arrays), params, num_samples, prompt_logprobs, topk)


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
    given = {k: body[k] for k in CALL_KEYS if body.get(k) is not None}
    return sample_request([prompt], **given, max_num_samples=max_num_samples, max_topk=max_topk)
