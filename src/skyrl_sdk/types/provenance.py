"""Provenance spans: where each position of a datum came from (Tinker's ``Datum.with_provenance``).

A datum's provenance is two lists of runs, one tiling ``model_input`` and one tiling
``target_tokens``. A run names a sampled sequence by its ``sequence_id`` and claims that its
positions are ``[offset, offset + length)`` of that sequence's *prompt*
(:class:`PromptProvenanceSpan`) or of its *sampled tokens* (:class:`SampledProvenanceSpan`).
StableReinforce checks these claims against the sequences the sampler recorded
(:mod:`skyrl_sdk.losses.stability`). Same names and fields as ``tinker.types``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import InputError
from .numbers import INT64_MAX, check_number


def _length(instance: Any, attribute: Any, value: Any) -> None:
    check_number(f"{type(instance).__name__}.{attribute.name}", value, low=0, high=INT64_MAX, integer=True)


def _sequence_id(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InputError(f"{type(instance).__name__}.sequence_id: expected a non-empty string, got {value!r}")


@attrs.frozen
class PromptProvenanceSpan:
    """A run of positions that are positions ``[offset, offset + length)`` of the prompt of
    the sampling request that produced sequence ``sequence_id``."""

    #: ``SampledSequence.sequence_id`` of a sequence whose request's prompt held this run.
    sequence_id: str = attrs.field(validator=_sequence_id)
    #: Number of consecutive positions in the run (>= 0).
    length: int = attrs.field(validator=_length)
    #: Where the run starts in that prompt.
    offset: int = attrs.field(default=0, validator=_length)


@attrs.frozen
class SampledProvenanceSpan:
    """A run of positions that are positions ``[offset, offset + length)`` of the sampled
    tokens of sequence ``sequence_id``."""

    #: ``SampledSequence.sequence_id`` of the sequence this run reproduces.
    sequence_id: str = attrs.field(validator=_sequence_id)
    #: Number of consecutive positions in the run (>= 0).
    length: int = attrs.field(validator=_length)
    #: Where the run starts in that sequence's sampled tokens.
    offset: int = attrs.field(default=0, validator=_length)


ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan
#: the two kinds by the ``kind`` a mapping gives
_KINDS: dict[str, type[ProvenanceSpan]] = {"prompt": PromptProvenanceSpan, "sampled": SampledProvenanceSpan}
#: ... and by the class name of a duck-typed ``tinker.types`` span
_CLASSES: dict[str, type[ProvenanceSpan]] = {cls.__name__: cls for cls in _KINDS.values()}


def span_from_any(value: Any, where: str) -> ProvenanceSpan:
    """One span: ours, a duck-typed ``tinker.types`` span (told apart by its class name), or a
    mapping ``{"kind": "prompt" | "sampled", "sequence_id", "length", "offset"}``."""
    if isinstance(value, (PromptProvenanceSpan, SampledProvenanceSpan)):
        return value
    if isinstance(value, Mapping):
        fields = dict(value)
        given = fields.pop("kind", None)
        kind = _KINDS.get(given) if isinstance(given, str) else None
        if kind is None:
            raise InputError(f"{where}: expected 'kind' to be 'prompt' or 'sampled', got {value.get('kind')!r}")
        unknown = sorted(set(fields) - {"sequence_id", "length", "offset"})
        if unknown:
            raise InputError(f"{where}: unknown keys {unknown}; accepted: kind, sequence_id, length, offset")
    else:
        kind = _CLASSES.get(type(value).__name__)
        if kind is None or not hasattr(value, "sequence_id"):
            raise InputError(f"{where}: expected a PromptProvenanceSpan or SampledProvenanceSpan, "
                             f"got {type(value).__name__}")
        fields = {k: getattr(value, k) for k in ("sequence_id", "length", "offset") if hasattr(value, k)}
    try:
        return kind(**fields)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise InputError(f"{where}: {exc}") from None


def spans_from_any(value: Any, field: str) -> tuple[ProvenanceSpan, ...] | None:
    """A list of spans (None stays None: no provenance)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InputError(f"{field}: expected a list of provenance spans, got {type(value).__name__}")
    return tuple(span_from_any(v, f"{field}[{i}]") for i, v in enumerate(value))


#: spans a field may have beyond one per position: an empty run covers nothing, but a turn of
#: one sampled token leaves one (its model input holds the sampled tokens but the last)
EXTRA_SPANS = 1


def span_count_problem(field: str, count: int, length: int) -> str | None:
    """Why ``count`` spans are too many for a field of ``length`` positions (None: they are not).
    Readers check it from the declared sizes before building any span (a datum of 200,000 empty
    spans cost 12x its body in memory)."""
    if count <= length + EXTRA_SPANS:
        return None
    return (f"{field}: {count} provenance spans for {length} positions; a field has at most one span per position "
            f"plus {EXTRA_SPANS} (the runs tile it)")


def check_tiling(field: str, spans: tuple[ProvenanceSpan, ...], length: int) -> None:
    """The runs of ``field`` must cover exactly its ``length`` positions, at most one run per
    position (plus :data:`EXTRA_SPANS`)."""
    if (problem := span_count_problem(field, len(spans), length)) is not None:
        raise InputError(problem)
    total = sum(s.length for s in spans)
    if total != length:
        raise InputError(f"{field}: the provenance spans cover {total} positions but the field has {length}; "
                         f"the runs must tile it exactly")
