"""The parameters of a call: ``AdamParams``, ``LoraConfig``, ``SamplingParams`` (Tinker's
names and defaults). Every number goes through :mod:`skyrl_sdk.types.numbers`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..errors import AdamParamsError, InputError
from .numbers import INT64_MAX, INT64_MIN, check_number, check_representable, number_validator, to_float

#: The smallest eps AdamW may use: float32's (and bfloat16's) smallest normal number. Below
#: it ``sqrt(v) + eps`` can round to 0 and the update becomes NaN.
MIN_ADAM_EPS = float(np.finfo(np.float32).tiny)


def _adam(low: float | None = None, high: float | None = None, **kw: Any) -> Callable[[Any, Any, Any], None]:
    return number_validator(low, high, qualified=True, error=AdamParamsError, **kw)


@attrs.frozen
class AdamParams:
    """AdamW hyper-parameters of one optim_step. All are honoured."""

    #: Step size (>= 0).
    learning_rate: float = attrs.field(default=1e-4, converter=to_float, validator=_adam(0.0))
    #: First-moment decay, in [0, 1).
    beta1: float = attrs.field(default=0.9, converter=to_float, validator=_adam(0.0, 1.0, high_open=True))
    #: Second-moment decay, in [0, 1).
    beta2: float = attrs.field(default=0.95, converter=to_float, validator=_adam(0.0, 1.0, high_open=True))
    #: Added to sqrt(second moment); at least float32's smallest normal number.
    eps: float = attrs.field(default=1e-12, converter=to_float, validator=_adam(MIN_ADAM_EPS))
    #: Decoupled weight decay (AdamW): weights are multiplied by ``1 - learning_rate * weight_decay``.
    weight_decay: float = attrs.field(default=0.0, converter=to_float, validator=_adam(0.0))
    #: Clip the global gradient norm to this value; 0 means no clipping.
    grad_clip_norm: float = attrs.field(default=0.0, converter=to_float, validator=_adam(0.0))

    def __attrs_post_init__(self) -> None:
        # every value meets float32 tensors in the step, as a loss config's numbers do: refused up
        # front (learning_rate=1e39 used to pass, the step was skipped as non-finite and the
        # pending gradients were lost)
        for field in attrs.fields(type(self)):
            check_representable(f"AdamParams.{field.name}", getattr(self, field.name), error=AdamParamsError)
        if self.learning_rate * self.weight_decay > 1.0:
            raise AdamParamsError(
                f"AdamParams: learning_rate * weight_decay must be <= 1 (the weights are multiplied by "
                f"1 - lr * wd each step), got {self.learning_rate} * {self.weight_decay}"
            )


def _is_bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{type(instance).__name__}.{attribute.name}: expected true or false, got {value!r}")


def _optional_int(instance: Any, attribute: Any, value: Any) -> None:
    """A seed: None or an int64 (what torch's generators take)."""
    if value is not None:
        check_number(f"{type(instance).__name__}.{attribute.name}", value, low=INT64_MIN, high=INT64_MAX,
                     integer=True)


#: the largest LoRA rank (a rank above a layer's width adds nothing; this bounds the memory a
#: request can ask for before the model is even looked at)
MAX_LORA_RANK = 2**16


@attrs.frozen
class LoraConfig:
    """LoRA adapters (trained with peft)."""

    #: Adapter rank (a positive integer).
    rank: int = attrs.field(default=8, validator=number_validator(1, MAX_LORA_RANK, integer=True, qualified=True))
    #: LoRA scaling numerator: the update is scaled by ``alpha / rank`` (Tinker's default 32).
    alpha: float = attrs.field(default=32.0, converter=to_float,
                               validator=number_validator(0.0, low_open=True, qualified=True))
    #: Seed of the adapters' initialisation (None: the Backend's seed).
    seed: int | None = attrs.field(default=None, validator=_optional_int)
    #: Adapt the MLP projections.
    train_mlp: bool = attrs.field(default=True, validator=_is_bool)
    #: Adapt the attention projections.
    train_attn: bool = attrs.field(default=True, validator=_is_bool)
    #: Adapt the output head (lm_head).
    train_unembed: bool = attrs.field(default=True, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise InputError("LoraConfig: at least one of train_mlp, train_attn, train_unembed must be true")


def _stop(value: Any) -> tuple[int | str, ...] | None:
    """Tinker's ``stop``: None, a string, a list of strings, or a list of token ids."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (bytes, dict)) or not hasattr(value, "__iter__"):
        raise InputError(f"SamplingParams.stop: expected a list of strings or token ids, got {type(value).__name__}")
    out: list[int | str] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise InputError(f"SamplingParams.stop[{i}]: expected a non-empty string")
            out.append(item)
        else:
            out.append(check_number(f"SamplingParams.stop[{i}]", item, low=0, high=INT64_MAX, integer=True))
    return tuple(out)


@attrs.frozen
class SamplingParams:
    """How to sample: Tinker's fields."""

    #: Most tokens to generate per sample (>= 1).
    max_tokens: int = attrs.field(default=16, validator=number_validator(1, INT64_MAX, integer=True, qualified=True))
    #: Softmax temperature (>= 0; 0 is greedy).
    temperature: float = attrs.field(default=1.0, converter=to_float,
                                     validator=number_validator(0.0, qualified=True))
    #: Keep the k most likely tokens (-1: off).
    top_k: int = attrs.field(default=-1, validator=number_validator(-1, INT64_MAX, integer=True, qualified=True))
    #: Nucleus sampling mass, in (0, 1].
    top_p: float = attrs.field(default=1.0, converter=to_float,
                               validator=number_validator(0.0, 1.0, low_open=True, qualified=True))
    #: Seed for reproducible draws (None: unseeded).
    seed: int | None = attrs.field(default=None, validator=_optional_int)
    #: Stop strings or stop token ids. None (default): stop at EOS; ``[]``: never stop early,
    #: not even at EOS; a list: stop at exactly these (EOS only if listed). Tinker's semantics.
    stop: tuple[int | str, ...] | None = attrs.field(default=None, converter=_stop)

    def __attrs_post_init__(self) -> None:
        if self.top_k == 0:
            raise InputError(f"SamplingParams.top_k: expected -1 (off) or a positive integer, got {self.top_k!r}")
