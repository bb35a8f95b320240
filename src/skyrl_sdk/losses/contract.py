"""What a caller sends each loss, per dialect: the inputs it must send, may send and must never
send, and the ``loss_fn_config`` keys that dialect accepts for it.

A :class:`~.base.LossSpec` declares what its *function* reads. A caller's view can differ: a
loss that ``needs_provenance`` gets ``logprobs`` and ``sampled_mask`` written from the datum's
provenance (:mod:`.stability`), so a caller may leave ``logprobs`` out and must never send
``sampled_mask``; and a dialect accepts its own config keys (Tinker's absolute
``clip_low_threshold`` for the native ``eps_clip_low``). ``skyrl-sdk losses`` prints this
contract, and ``tests/test_loss_contract.py`` checks it against what each loss really accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .base import DialectSpec, LossSpec
from .stability import COMPUTED_INPUTS, SAMPLED_MASK
from .terms import term_keys


@attrs.frozen
class InputContract:
    """A loss's inputs as a caller sees them."""

    #: keys every datum must carry
    required: tuple[str, ...]
    #: keys a datum may carry
    optional: tuple[str, ...]
    #: keys the SDK computes: a datum that carries one is refused
    never_send: tuple[str, ...]
    #: why a key is where it is (only where the spec alone would mislead)
    notes: Mapping[str, str] = attrs.field(factory=dict)


def caller_inputs(spec: LossSpec) -> InputContract:
    """``spec``'s inputs from the caller's side (see the module docstring)."""
    if not spec.needs_provenance:
        return InputContract(tuple(spec.required_inputs), tuple(spec.optional_inputs), ())
    written = set(COMPUTED_INPUTS)
    never = tuple(k for k in COMPUTED_INPUTS if k == SAMPLED_MASK)
    may = tuple(k for k in COMPUTED_INPUTS if k != SAMPLED_MASK and k in spec.required_inputs + spec.optional_inputs)
    return InputContract(
        required=tuple(k for k in spec.required_inputs if k not in written),
        optional=tuple(k for k in spec.optional_inputs if k not in written) + may,
        never_send=never,
        notes={**{k: COMPUTED_INPUTS[k] for k in may}, **{k: COMPUTED_INPUTS[k] for k in never}},
    )


def dialect_config_keys(dialect: DialectSpec, name: str, spec: LossSpec) -> dict[str, Any]:
    """The ``loss_fn_config`` keys (with their defaults) a client of ``dialect`` sends when it
    calls ``spec`` by ``name``, besides the loss terms every loss takes.

    A dialect that maps keys declares them with a ``config_keys(name, role, spec)`` attribute on
    its converter (None for a name it does not claim); a name it does not claim, or a dialect
    that declares nothing, takes the loss's own keys as they are."""
    declared = getattr(dialect.convert, "config_keys", None)
    keys = declared(name, spec.role, spec) if declared is not None else None
    return dict(keys) if keys is not None else spec.config_defaults()


def shared_config_keys(spec: LossSpec) -> tuple[str, ...]:
    """The loss-term keys every loss of ``spec``'s role takes (the same in every dialect)."""
    return term_keys(spec.role)
