"""Everything knowable about a call, checked before any compute, so bad input changes no state.

:func:`check_loss_inputs` is the per-datum check of a loss's inputs (keys, shapes; also
used by ``evaluate_loss``); :func:`validate_data` checks a whole call. Messages name the
datum index, the key, what was expected and what came.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import DatumError, InputError, LossConfigError, did_you_mean
from ..inputs.limits import prompt_length_problem, sequence_length_problem
from ..types import Datum
from ..types.numbers import check_representable
from .base import LossSpec, check_finite_inputs
from .contract import caller_inputs
from .reduction import PER_TOKEN_REDUCTIONS
from .resolve import ResolvedLoss
from .terms import TERM_INPUT_SOURCES, TERM_INPUTS, with_call_normalizers


def check_call(data: Sequence[Datum], resolved: ResolvedLoss, vocab_size: int | None,
               max_positions: int | None = None) -> ResolvedLoss:
    """Everything knowable about a call, before any compute: the loss's config and terms
    (:func:`check_resolved`), every datum against the loss and the model's vocabulary and
    positions (:func:`validate_data`), the same keys on every datum, what the loss terms need;
    returns ``resolved`` with the call-level normalizers of its reduction filled in."""
    check_resolved(resolved)
    validate_data(data, resolved.spec, vocab_size, label=resolved.label, max_positions=max_positions,
                  hints=resolved.hints)
    check_same_keys(data)
    if resolved.terms.kl_coef > 0:
        for i, d in enumerate(data):
            shape = d.loss_fn_inputs["target_tokens"].shape if "target_tokens" in d.loss_fn_inputs else ()
            if len(shape) == 2:
                raise DatumError("kl_coef > 0 needs one target per position (shape (N,)), got top-K targets "
                                 f"of shape {list(shape)}", index=i, key="target_tokens")
    return with_call_normalizers(resolved, data)


def check_resolved(resolved: ResolvedLoss) -> None:
    """What a resolved loss itself must satisfy before any compute: every number of its config
    and terms representable in the compute dtypes (:func:`~skyrl_sdk.types.numbers.check_representable`),
    and the per-token loss a per-sequence reduction weights declared by the loss.

    A loss declares that it returns a differentiable ``elementwise_loss`` (with
    ``elementwise_loss.sum() == loss``) by listing ``"elementwise_loss"`` in ``LossSpec.outputs``."""
    for key, value in (*_numbers_of(resolved.config), *_numbers_of(resolved.terms)):
        check_representable(f"{resolved.label}: loss_fn_config[{key!r}]", value, error=LossConfigError)
    reduction = resolved.terms.loss_reduction
    if reduction in PER_TOKEN_REDUCTIONS and "elementwise_loss" not in resolved.spec.outputs:
        raise LossConfigError(
            f"{resolved.label} does not declare elementwise_loss among its outputs "
            f"{list(resolved.spec.outputs)}, so it cannot use loss_reduction {reduction!r} (which weights "
            f"each token's loss per sequence); use 'sum' or a uniform reduction"
        )


def _numbers_of(config: Any) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every field of an attrs config (the registry requires attrs config
    classes), list and tuple fields item by item (``key[i]``)."""
    if config is None or not attrs.has(type(config)):
        return
    for key, value in attrs.asdict(config, recurse=False).items():
        if isinstance(value, (list, tuple)):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value))
        else:
            yield str(key), value


def check_prompts(prompts: Sequence[np.ndarray], vocab_size: int, max_positions: int | None,
                  max_tokens: int) -> None:
    """A sample call's prompts: valid token ids, and each prompt plus ``max_tokens`` within the
    model's positions (the server checks its own limit in the same words)."""
    for i, tokens in enumerate(prompts):
        problem = token_range_problem(tokens, vocab_size) or prompt_length_problem(
            int(tokens.size), max_tokens, max_positions)
        if problem:
            raise InputError(f"prompt {i}: {problem}")


def check_target_ids(targets: Sequence[np.ndarray | None] | None, vocab_size: int) -> None:
    """A sample call's ``target_prompt_logprobs`` (shapes checked by ``SampleRequest``): every
    token id named lies in the model's vocabulary."""
    if not targets:
        return
    for i, ids in enumerate(targets):
        if ids is not None and (ids >= vocab_size).any():
            r, c = (int(x) for x in np.argwhere(ids >= vocab_size)[0])
            where = f"target_prompt_logprobs[{i}]" if len(targets) > 1 else "target_prompt_logprobs"
            raise InputError(f"{where}[{r}, {c}]: token id {int(ids[r, c])} is outside the vocabulary "
                             f"(0..{vocab_size - 1}; -1 asks for nothing)")


def validate_data(data: Sequence[Datum], spec: LossSpec, vocab_size: int | None, label: str | None = None,
                  max_positions: int | None = None, hints: Mapping[str, str] | None = None) -> None:
    """Validate a whole batch against a loss; raise :class:`DatumError` on the first problem
    (``hints``: see :func:`check_loss_inputs`)."""
    for i, datum in enumerate(data):
        tokens = datum.model_input.to_numpy()
        n = int(tokens.shape[0])
        if n == 0:
            raise DatumError("model_input is empty; expected at least one token", index=i, key="model_input")
        problem = sequence_length_problem(n, max_positions)
        if problem:
            raise DatumError(problem, index=i)
        if vocab_size is not None:
            check_token_range(tokens, vocab_size, i, "model_input")
        shapes = {k: v.shape for k, v in datum.loss_fn_inputs.items()}
        check_loss_inputs(spec, shapes, n, index=i, label=label, hints=hints)
        check_finite_inputs(datum, i)
        for key, tensor in datum.loss_fn_inputs.items():
            if key == "target_tokens":
                if vocab_size is not None:
                    check_token_range(tensor.array, vocab_size, i, key)
            elif key in _RATIO_BOUNDS:
                _check_ratio_bound(tensor.array, key, i)


def token_range_problem(tokens: np.ndarray, vocab_size: int) -> str | None:
    """Why ``tokens`` are not valid ids of a ``vocab_size`` vocabulary (first offender), or None."""
    flat = tokens.reshape(-1)
    if flat.size == 0 or (int(flat.min()) >= 0 and int(flat.max()) < vocab_size):
        return None
    bad = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
    return f"token ids must be in [0, {vocab_size}) (the vocabulary size), got {int(flat[bad])} at flat position {bad}"


def check_token_range(tokens: np.ndarray, vocab_size: int, index: int, key: str) -> None:
    problem = token_range_problem(tokens, vocab_size)
    if problem:
        raise DatumError(problem, index=index, key=key)


#: Per-token absolute ratio bounds (Tinker): 0 <= clip_low_threshold <= 1 <= clip_high_threshold
#: (which also orders them, so no separate low <= high check is needed).
_RATIO_BOUNDS = {"clip_low_threshold": (0.0, 1.0), "clip_high_threshold": (1.0, np.inf)}


def _check_ratio_bound(array: np.ndarray, key: str, index: int) -> None:
    lo, hi = _RATIO_BOUNDS[key]
    bad = np.flatnonzero((array < lo) | (array > hi))
    if bad.size:
        pos = int(bad[0])
        expected = "0 <= value <= 1" if key == "clip_low_threshold" else "value >= 1"
        raise DatumError(
            f"expected an absolute ratio bound with {expected}, got {float(array[pos]):.6g} at position {pos}",
            index=index, key=key,
        )


def inputs_for_forward(datums: Sequence[Datum], spec: LossSpec, known: set[str]) -> list[Datum]:
    """The datums a forward pass (no gradient) scores: without the keys ``spec`` does not take
    that other losses or the loss terms use (``known``), so a reference model's
    ``forward(data, "cross_entropy")`` takes the policy's datums as they are. A key no loss
    uses is kept, and refused by validation as usual (a typo is never dropped silently)."""
    accepted = set(spec.required_inputs) | set(spec.optional_inputs)
    unused = (known | set(TERM_INPUTS)) - accepted
    return [d if unused.isdisjoint(d.loss_fn_inputs) else
            Datum(model_input=d.model_input,
                  loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k not in unused})
            for d in datums]


def check_same_keys(datums: Sequence[Datum]) -> None:
    """All datums of a call carry the same loss_fn_inputs keys (they are packed together)."""
    first = set(datums[0].loss_fn_inputs)
    for i, d in enumerate(datums[1:], start=1):
        keys = set(d.loss_fn_inputs)
        if keys != first:
            raise DatumError(
                f"loss_fn_inputs keys {sorted(keys)} differ from datum 0's {sorted(first)}; "
                f"every datum of a call must carry the same keys",
                index=i,
            )


def check_loss_inputs(
    spec: LossSpec, shapes: Mapping[str, tuple[int, ...]], n: int, *, index: int, need_targets: bool = True,
    label: str | None = None, hints: Mapping[str, str] | None = None,
) -> None:
    """Required keys present, no unknown keys, first dimension equal to the datum length.

    ``label`` names the loss as the caller typed it (``ResolvedLoss.label``); ``hints`` (the
    ``ResolvedLoss.hints``) adds to the error of a missing input why the call needs it when a
    config key probably meant another (``kl_coef`` for the loss's own ``kl_coeff``)."""
    label = label or f"loss {spec.name!r}"
    accepted = set(spec.required_inputs) | set(spec.optional_inputs)
    for key in spec.required_inputs:
        if key == "target_tokens" and not need_targets:
            continue
        if key not in shapes:
            source = f"; {key}: {TERM_INPUT_SOURCES[key]}" if key in TERM_INPUT_SOURCES else ""
            if hints and key in hints:
                source = f"; {hints[key]}{source}"
            caller = caller_inputs(spec)  # what the caller sends (not what provenance writes)
            required = [k for k in spec.required_inputs if k in caller.required or k in TERM_INPUTS]
            sent = sorted(k for k in shapes if k not in caller.never_send)
            raise DatumError(f"{label} requires input {key!r} (required: {required}), got keys {sent}{source}",
                             index=index)
    for key, shape in shapes.items():
        if key not in accepted:
            hint = (f"; it is a loss term's input: set {TERM_INPUTS[key]} in loss_fn_config, or drop it"
                    if key in TERM_INPUTS else did_you_mean(key, accepted))
            raise DatumError(f"{label} does not take this input; accepted inputs: {sorted(accepted)}{hint}",
                             index=index, key=key)
        if len(shape) == 0 or shape[0] != n:
            raise DatumError(
                f"expected first dimension {n} (the model_input length), got shape {list(shape)}",
                index=index,
                key=key,
            )
        topk_ok = spec.accepts_topk_targets and key in ("target_tokens", "weights")
        if len(shape) != 1 and not (topk_ok and len(shape) == 2):
            expected = "(N,) or (N, K)" if topk_ok else "(N,)"
            raise DatumError(f"expected shape {expected} with N={n}, got {list(shape)}", index=index, key=key)
    if spec.accepts_topk_targets and "target_tokens" in shapes and "weights" in shapes:
        if shapes["target_tokens"] != shapes["weights"]:
            raise DatumError(
                f"weights shape {list(shapes['weights'])} must equal target_tokens shape "
                f"{list(shapes['target_tokens'])}",
                index=index,
                key="weights",
            )
