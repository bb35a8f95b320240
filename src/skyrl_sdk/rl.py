"""Small helpers for RL loops: group-relative advantages and the datum of one sample.

They spell out the steps every GRPO-style loop repeats (see docs/rl.md): normalize a
group's rewards into advantages, and turn ``prompt + sampled completion`` into a Datum
whose prompt positions are not trained; a PPO loop with a KL term also adds a frozen
reference's logprobs to those datums (docs/skyrl-parity.md). Over HTTP the tinker client
wants its own ``tinker.types.Datum``: :func:`tinker_datum_from_sample` builds it, with the
provenance ``stable_reinforce`` needs, from the client's own samples (docs/rl.md, "Over HTTP").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from .errors import InputError, install_hint
from .types import (
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ImageChunk,
    ModelInput,
    PromptProvenanceSpan,
    ProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
)


def group_advantages(rewards: Sequence[float], *, normalize: bool = True, eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` over one group of samples of the same prompt.

    With ``normalize=False`` only the mean is subtracted. A group whose rewards are all
    equal gets zeros: it carries no signal about which sample was better.
    """
    values = [float(r) for r in rewards]
    if not values or not all(math.isfinite(v) for v in values):
        raise InputError(f"rewards: expected a non-empty list of finite numbers, got {list(rewards)!r}")
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    if not normalize:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(values))
    return [c / (std + eps) for c in centred]


def _prompt_tokens(prompt: Any) -> list[int]:
    """A prompt as token ids: a list of ints, our ``ModelInput`` or the tinker client's (text only)."""
    if isinstance(prompt, ModelInput):
        if prompt.has_images:
            raise InputError("prompt: expected tokens only; a prompt with images has no token list to train on here")
        return [int(t) for t in prompt.to_numpy()]
    if hasattr(prompt, "to_ints"):  # tinker.types.ModelInput
        return [int(t) for t in prompt.to_ints()]
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise InputError(f"prompt: expected a list of token ids or a ModelInput, got {type(prompt).__name__}")
    return [int(t) for t in prompt]


def datum_from_sample(prompt: Sequence[int] | Any, sample: SampledSequence | Any, advantage: float, *,
                      weights: bool = False) -> Datum:
    """The training Datum of one sampled completion of ``prompt``.

    The model reads ``prompt + completion`` shifted by one; ``target_tokens`` are the next
    tokens, ``logprobs`` the sampler's logprobs of the completion (what importance
    sampling and PPO compare the new policy with), ``advantages`` the advantage on every
    completion token. Prompt positions carry logprob 0 and advantage 0, so they add
    nothing to the loss. The keys fit ``importance_sampling``, ``ppo`` and the other
    policy-gradient losses.

    A sample recorded with ``record_stability_info=True`` (it has a ``sequence_id``) also
    gets the provenance ``stable_reinforce`` needs: the prompt positions name its request's
    prompt, the rest its sampled tokens.

    ``weights=True`` adds ``weights``: 0 on prompt positions, 1 on the completion. A summed
    loss does not need it; a mean (``loss_reduction="token_mean"``, a KL or entropy term)
    does, or the prompt positions count in its denominator.

    ``prompt`` may also be a ``ModelInput`` of tokens (ours or the tinker client's) and
    ``sample`` the tinker client's ``SampledSequence``.
    """
    prompt = _prompt_tokens(prompt)
    tokens = [int(t) for t in sample.tokens]
    if not prompt:
        raise InputError("prompt: expected at least one token")
    if not tokens:
        raise InputError("sample.tokens: the completion is empty; there is nothing to train on")
    if sample.logprobs is None:
        raise InputError("sample.logprobs: the sample has no logprobs (the sampler did not return them)")
    if len(sample.logprobs) != len(tokens):
        raise InputError(f"sample.logprobs: expected {len(tokens)} values (one per token), got {len(sample.logprobs)}")
    if not math.isfinite(advantage):
        raise InputError(f"advantage: expected a finite number, got {advantage!r}")
    full = prompt + tokens
    n_prompt = len(prompt) - 1  # positions whose target is still a prompt token
    inputs = {
        "target_tokens": full[1:],
        "logprobs": [0.0] * n_prompt + [float(x) for x in sample.logprobs],
        "advantages": [0.0] * n_prompt + [float(advantage)] * len(tokens),
    }
    if weights:
        inputs["weights"] = [0.0] * n_prompt + [1.0] * len(tokens)
    datum = Datum(model_input=ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)
    if sample.sequence_id is None:
        return datum
    sid = sample.sequence_id  # recorded (record_stability_info=True): name it, as stable_reinforce needs
    if not isinstance(sid, str) or not sid:
        raise InputError(f"sample.sequence_id: expected a non-empty string (or None), got {sid!r}")
    return datum.with_provenance(
        model_input=[PromptProvenanceSpan(sid, len(prompt)), SampledProvenanceSpan(sid, len(tokens) - 1)],
        loss_fn_inputs=[PromptProvenanceSpan(sid, n_prompt, offset=1), SampledProvenanceSpan(sid, len(tokens))])


def to_tinker(datum: Datum) -> Any:
    """``datum`` as the tinker client's ``tinker.types.Datum``: the same ``model_input`` (text and
    image chunks), ``loss_fn_inputs`` (arrays as they are) and provenance spans. Needs the
    ``tinker`` package (the ``server`` extra)."""
    try:
        from tinker import types as tt
    except ImportError:
        raise InputError(f"to_tinker needs the tinker client: {install_hint('server')}") from None
    chunks: list[tt.ModelInputChunk] = []
    for i, chunk in enumerate(datum.model_input.chunks):
        if isinstance(chunk, EncodedTextChunk):
            chunks.append(tt.EncodedTextChunk(tokens=[int(t) for t in chunk.tokens]))
        elif isinstance(chunk, ImageChunk):
            chunks.append(tt.ImageChunk(data=chunk.data, format=chunk.format, expected_tokens=chunk.expected_tokens))
        else:
            raise InputError(f"model_input.chunks[{i}]: a {type(chunk).__name__} has no tinker form")
    inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
    # tinker annotates TensorData values; its Datum converts numpy arrays itself (__post_init__)
    out = tt.Datum(model_input=tt.ModelInput(chunks=chunks), loss_fn_inputs=inputs)  # type: ignore[arg-type]
    if datum.model_input_spans is None or datum.loss_fn_input_spans is None:  # both or neither
        return out

    def spans(values: Sequence[ProvenanceSpan]) -> list:
        return [(tt.SampledProvenanceSpan if isinstance(s, SampledProvenanceSpan) else tt.PromptProvenanceSpan)(
            sequence_id=s.sequence_id, length=s.length, offset=s.offset) for s in values]

    return out.with_provenance(model_input=spans(datum.model_input_spans),
                               loss_fn_inputs=spans(datum.loss_fn_input_spans))


def tinker_datum_from_sample(prompt: Sequence[int] | Any, sample: Any, advantage: float, *,
                             weights: bool = False) -> Any:
    """:func:`datum_from_sample` as the tinker client's ``tinker.types.Datum``: for a loop over
    HTTP, from a sampling client's ``SampledSequence`` (and its prompt). A sequence sampled by a
    client created with ``record_stability_info=True`` carries a ``sequence_id``; the datum then
    names it in its provenance, as ``stable_reinforce`` needs."""
    return to_tinker(datum_from_sample(prompt, sample, advantage, weights=weights))


def with_ref_logprobs(data: Sequence[Datum], reference: ForwardBackwardOutput) -> list[Datum]:
    """``data`` with ``ref_logprobs`` added: the logprobs ``reference`` (a frozen reference
    Backend's ``forward(data, "cross_entropy")`` on the same datums) gave their targets. The
    input a KL term (``kl_coef > 0``) compares the policy with."""
    outputs = reference.loss_fn_outputs
    if len(outputs) != len(data):
        raise InputError(f"reference: expected the output of forward on these {len(data)} datums, "
                         f"got {len(outputs)} outputs")
    out = []
    for i, (datum, output) in enumerate(zip(data, outputs, strict=True)):
        ref = output["logprobs"].to_numpy() if "logprobs" in output else None
        if ref is None or ref.shape != (datum.model_input.length,):
            got = "no logprobs" if ref is None else f"logprobs of shape {list(ref.shape)}"
            raise InputError(f"reference output {i}: expected logprobs of shape [{datum.model_input.length}] "
                             f"(datum {i}'s length), got {got}")
        out.append(attrs.evolve(datum, loss_fn_inputs={**datum.loss_fn_inputs, "ref_logprobs": ref}))
    return out
