"""``SampleRequest``: one sample call, the one object that goes from the caller to the sampler.

Like vLLM's ``SamplingParams`` it is built once (``Backend.sample``'s arguments, or Tinker's JSON
``SampleRequest`` over HTTP, both through :mod:`skyrl_sdk.inputs.sample`) and then handed on
unchanged: to ``Backend.sample_request``, the server's batches, the ``Sampler``, our decode loop
and the FSDP ranks. A new option is one new field here, and each field says by its metadata
what it is to the code that handles requests in bulk:

- an *option* (no role, the default): it changes the samples or the scores, so two requests
  can share one sampler call only when it is equal in both (:meth:`SampleRequest.batch_key`);
- :data:`PER_PROMPT`: one entry per prompt (``prompts``, ``target_prompt_logprobs``): a batch
  of requests concatenates them (:meth:`SampleRequest.batched`);
- :data:`CALLER`: served by whoever takes the call (``Backend.sample_request`` records the
  sequences), never by a sampler, and it changes no sample.

The request checks itself however it is built (keyword arguments only), as every type here
does; the caller's bounds (the server's most samples and widest top-k) and the model's (its
vocabulary, its positions) are checked by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InputError, quoted
from .model_input import ModelInput
from .numbers import Validator, check_number
from .params import SamplingParams

#: metadata role of a field holding one entry per prompt (a batch concatenates it)
PER_PROMPT = "per_prompt"
#: metadata role of a field the caller of a sampler serves (it changes no sample)
CALLER = "caller"
#: most token ids a ``target_prompt_logprobs`` row may name (its K)
MAX_TARGET_PROMPT_IDS = 1024
#: the fields that ask for a number of (token, logprob) pairs or draws per position
WIDTHS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


def _role(role: str) -> dict[str, str]:
    return {"role": role}


def role_of(field: attrs.Attribute) -> str | None:
    """A field's role (:data:`PER_PROMPT`, :data:`CALLER`), or None for an option."""
    return field.metadata.get("role")


def _flag(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{attribute.name}: expected true or false, got {quoted(value)}")


def _count(low: int) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        check_number(attribute.name, value, low=low, integer=True)
    return check


def _sampling_params(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, SamplingParams):
        raise InputError(f"sampling_params: expected a SamplingParams, got {type(value).__name__}")


def _prompts(instance: Any, attribute: attrs.Attribute, value: tuple) -> None:
    if not value:
        raise InputError("prompts is empty")
    for i, prompt in enumerate(value):
        if isinstance(prompt, ModelInput):
            if not prompt.has_images:
                raise InputError(f"prompt {i}: a prompt without images is its int64 token-id array")
        elif not (isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype == np.int64):
            raise InputError(f"prompt {i}: expected a 1-D int64 array of token ids (or a ModelInput with images), "
                             f"got {type(prompt).__name__}")
        elif prompt.size == 0:
            raise InputError(f"prompt {i}: expected at least one token")


def _prompt_tuple(value: Iterable[np.ndarray | ModelInput]) -> tuple[np.ndarray | ModelInput, ...]:
    return tuple(value)


def _optional_tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True, eq=False)
class SampleRequest:
    """One checked sample call (see the module docstring); Tinker's names and defaults, in
    ``Backend.sample``'s order."""

    #: each prompt's token ids (1-D int64, at least one token), or its ``ModelInput`` when it
    #: holds images (read by the model's image processor before a sampler gets it)
    prompts: tuple[np.ndarray | ModelInput, ...] = attrs.field(converter=_prompt_tuple, validator=_prompts,
                                                                metadata=_role(PER_PROMPT))
    #: how to draw (temperature, top-k / top-p, stop rules, seed, max_tokens)
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams, validator=_sampling_params)
    #: continuations per prompt (>= 1)
    num_samples: int = attrs.field(default=1, validator=_count(1))
    #: each prompt token's logprob given the ones before
    prompt_logprobs: bool = attrs.field(default=False, validator=_flag)
    #: per prompt position, the k most likely (token id, logprob) pairs (0: none)
    topk_prompt_logprobs: int = attrs.field(default=0, validator=_count(0))
    #: record every sampled sequence for ``stable_reinforce``, each with a ``sequence_id`` a
    #: datum's provenance names (served by ``Backend.sample_request``, not by the sampler)
    record_stability_info: bool = attrs.field(default=False, validator=_flag, metadata=_role(CALLER))
    #: per sampled position, the k most likely (token id, logprob) pairs: each sequence's
    #: ``topk_logprobs`` (0: none)
    topk_sample_logprobs: int = attrs.field(default=0, validator=_count(0))
    #: per prompt, an int64 ``[len(prompt) - 1, K]`` array of token ids to score at positions
    #: 1.. (-1: none), or None; at least one array when given (the output's ``target_prompt_logprobs``)
    target_prompt_logprobs: tuple[np.ndarray | None, ...] | None = attrs.field(
        default=None, converter=_optional_tuple, metadata=_role(PER_PROMPT))
    #: k draws at every prompt position after the first, at the request's temperature: the
    #: output's ``prompt_alt_tokens`` (0: none)
    prompt_alt_tokens_k: int = attrs.field(default=0, validator=_count(0))

    def __attrs_post_init__(self) -> None:
        images = any(isinstance(p, ModelInput) for p in self.prompts)
        for name in ("record_stability_info", "prompt_alt_tokens_k"):
            if images and getattr(self, name):
                raise InputError(f"{name}: not available for a prompt with images")
        if self.target_prompt_logprobs is not None:
            _check_targets(self.prompts, self.target_prompt_logprobs)

    def prompt_token_ids(self) -> list[np.ndarray]:
        """Each prompt's token ids (a prompt with images: once read, its image placeholders'
        ids; an image not read yet raises ``InputError``)."""
        return [p.to_numpy() if isinstance(p, ModelInput) else p for p in self.prompts]

    # ---- what bulk handling reads from the fields' roles ----------------------------------------
    def batch_key(self) -> tuple:
        """Every option (a field without a role), by name: requests with equal keys can be
        served by one call of :meth:`batched` (the server merges a group's requests so)."""
        return tuple((f.name, getattr(self, f.name)) for f in attrs.fields(type(self)) if role_of(f) is None)

    @staticmethod
    def batched(requests: Sequence[SampleRequest]) -> SampleRequest:
        """One request for all of ``requests``' prompts, in order (their outputs follow in the
        same order); they must have equal :meth:`batch_key`. The :data:`CALLER` fields take
        their defaults: whoever batches serves them for each request."""
        first = requests[0]
        for r in requests[1:]:
            if r.batch_key() != first.batch_key():
                raise ValueError("SampleRequest.batched: the requests differ in an option (their batch_key)")
        merged: dict[str, Any] = {}
        for f in attrs.fields(type(first)):
            if role_of(f) == CALLER:
                merged[f.name] = f.default
            elif role_of(f) == PER_PROMPT:
                merged[f.name] = _concatenated(f.name, requests)
        return attrs.evolve(first, **merged)

    def options_set(self) -> list[str]:
        """The options this request sets away from their defaults, as a sampler serves or refuses
        them: ``SamplingParams``' fields as ``sampling_params.<name>``, then the request's own
        (every field but ``prompts`` and the :data:`CALLER` fields)."""
        default_params = SamplingParams()
        names = [f"sampling_params.{f.name}" for f in attrs.fields(SamplingParams)
                 if getattr(self.sampling_params, f.name) != getattr(default_params, f.name)]
        for f in attrs.fields(type(self)):
            if f.name not in ("prompts", "sampling_params") and role_of(f) != CALLER \
                    and not _is_default(getattr(self, f.name), f.default):
                names.append(f.name)
        return names


def _is_default(value: Any, default: Any) -> bool:
    return value is None if default is None else bool(value == default)


def _concatenated(name: str, requests: Sequence[SampleRequest]) -> tuple | None:
    """A :data:`PER_PROMPT` field over ``requests``: its entries in order (None per prompt of a
    request without it), or None when no request has it."""
    if all(getattr(r, name) is None for r in requests):
        return None
    out: list[Any] = []
    for r in requests:
        value = getattr(r, name)
        out += list(value) if value is not None else [None] * len(r.prompts)
    return tuple(out)


def _check_targets(prompts: tuple, targets: tuple) -> None:
    """``target_prompt_logprobs``: one entry per prompt, each None or an int64 ``[len(prompt) - 1,
    K]`` array naming at least one token id (-1: none); at least one array in all. The token ids
    against the vocabulary are the model's to check."""
    if len(targets) != len(prompts):
        raise InputError(f"target_prompt_logprobs: expected one entry per prompt ({len(prompts)}): an int64 "
                         f"[len(prompt) - 1, K] array of token ids (-1: none), or None")
    if all(t is None for t in targets):
        raise InputError("target_prompt_logprobs: every entry is None (give None instead)")
    for i, (prompt, ids) in enumerate(zip(prompts, targets, strict=True)):
        where = f"target_prompt_logprobs[{i}]" if len(prompts) > 1 else "target_prompt_logprobs"
        if ids is None:
            continue
        if isinstance(prompt, ModelInput):
            raise InputError(f"{where}: not available for a prompt with images (its positions are known only "
                             f"once the image processor has read them)")
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
            raise InputError(f"{where}: expected an int64 array of token ids, got {type(ids).__name__}")
        rows = int(prompt.size) - 1
        if ids.ndim != 2 or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TARGET_PROMPT_IDS:
            raise InputError(f"{where}: expected shape [len(prompt) - 1, K] = [{rows}, K] with 1 <= K <= "
                             f"{MAX_TARGET_PROMPT_IDS}, got {list(ids.shape)}")
        if (ids < -1).any():
            r, c = (int(x) for x in np.argwhere(ids < -1)[0])
            raise InputError(f"{where}[{r}, {c}]: expected a token id or -1 (none), got {int(ids[r, c])}")
        if not (ids >= 0).any():
            raise InputError(f"{where}: names no token id (every cell is -1)")
