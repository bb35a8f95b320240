"""A call's data on its one way down, from what the caller sent to what the engine runs.

``Backend.forward_backward`` / ``forward`` hand their data here once (:func:`prepare_call`),
and ``Backend.sample_request`` its request (:func:`prepare_sample`); nothing comes back up to
the facade until it is ready: made our types (:mod:`skyrl_sdk.inputs`), images read by the
model's image processor, provenance resolved against the recorded sequences
(:mod:`.stability`), then everything knowable checked before compute (:mod:`.validation`).
What the model contributes comes in as one value, :class:`CallModel`, built by the caller
from its engine, so this layer never reaches up to the engines or the models.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ..errors import DatumError, InputError
from ..inputs.coerce import data_from_any
from ..types import Datum, ModelInput, SampleRequest
from .base import LossSpec
from .resolve import ResolvedLoss, reading_values
from .stability import Records, resolve_provenance
from .validation import check_call, check_prompts, check_target_ids, inputs_for_forward

T = TypeVar("T")


class ImageReader(Protocol):
    """A model's image processor under its image limits (``skyrl_sdk.models.images.ImageInputs``)."""

    def prepare_steps(self, inputs: Sequence[ModelInput],
                      error: Callable[[int, str], InputError]) -> Generator[None, None, list[ModelInput]]:
        """``inputs`` with every image read (``error(i, message)`` builds input ``i``'s error), as
        a stepped call that yields between two decodes."""
        ...


@attrs.frozen(eq=False, kw_only=True)
class CallModel:
    """What a call's data is completed and checked against: the model's name (for messages),
    vocabulary and positions, its image reader (None: it reads no images) and the sequences
    recorded for ``stable_reinforce`` that provenance names."""

    name: str
    vocab_size: int
    max_positions: int | None
    images: ImageReader | None
    sequences: Records

    def read_images(self, inputs: list[ModelInput],
                    error: Callable[[int, str], InputError]) -> Generator[None, None, list[ModelInput]]:
        """``inputs`` with their images read (checked against the image limits first, then
        decoded, yielding between two decodes), or refused by name when the model reads no images."""
        if not any(mi.has_images for mi in inputs):
            return inputs
        if self.images is None:
            i = next(i for i, mi in enumerate(inputs) if mi.has_images)
            raise error(i, f"model_input holds an image, but model {self.name!r} reads no images (it is not a "
                           f"vision-language model: Qwen2-VL, Qwen2.5-VL or Qwen3-VL)")
        return (yield from self.images.prepare_steps(inputs, error))


def prepare_call(data: Sequence[Any], resolved: ResolvedLoss, model: CallModel, *, backward: bool,
                 losses: Mapping[str, LossSpec]) -> Generator[None, None, tuple[list[Datum], ResolvedLoss]]:
    """A ``forward_backward`` (``backward``) or ``forward`` call's datums, ready for the engine,
    and ``resolved`` with its call-level normalizers: ``data`` made ``Datum``s, their images
    read, their provenance resolved when the loss needs it, a forward's datums stripped of the
    other losses' inputs (``losses``: every registered loss), then the whole call checked. A
    bad call raises before anything is computed. A stepped call (``engines.turns.Steps``): it
    yields between two image decodes, where its driver may give others their turns."""
    datums = data_from_any(data)
    inputs = yield from model.read_images([d.model_input for d in datums], lambda i, msg: DatumError(msg, index=i))
    datums = [d if mi is d.model_input else attrs.evolve(d, model_input=mi) for d, mi in zip(datums, inputs,
                                                                                            strict=True)]
    if resolved.spec.needs_provenance:  # the recorded sampler logprobs, named by each datum's provenance
        datums = resolve_provenance(datums, model.sequences)
    if not backward:  # no gradient: take the inputs this loss reads, leave the other losses' alone
        known = {k for spec in losses.values() for k in spec.required_inputs + spec.optional_inputs}
        datums = inputs_for_forward(datums, resolved.spec, known)
        if datums:  # a critic's datums without values/returns: read the values
            resolved = reading_values(resolved, set(datums[0].loss_fn_inputs))
    return datums, check_call(datums, resolved, model.vocab_size, model.max_positions)


def prepare_sample(request: SampleRequest, model: CallModel) -> SampleRequest:
    """``request`` ready for a sampler: its prompts' images read (the same request when it has
    none), every prompt's token ids and its length plus ``max_tokens`` within the model's, and
    the ``target_prompt_logprobs`` ids within the vocabulary."""
    with_images = [(i, p) for i, p in enumerate(request.prompts) if isinstance(p, ModelInput)]
    if with_images:
        where = [i for i, _ in with_images]
        read = _to_end(model.read_images([p for _, p in with_images],
                                         lambda k, msg: InputError(f"prompt {where[k]}: {msg}")))
        prompts = list(request.prompts)
        for i, model_input in zip(where, read, strict=True):
            prompts[i] = model_input
        request = attrs.evolve(request, prompts=prompts)
    check_prompts(request.prompt_token_ids(), model.vocab_size,
                  model.max_positions, request.sampling_params.max_tokens)
    check_target_ids(request.target_prompt_logprobs, model.vocab_size)
    return request


def _to_end(steps: Generator[None, None, T]) -> T:
    """A stepped call run to its end here (a sample's prompts give way to nobody)."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value
