"""One rule for every number a caller or a config gives us.

Why one place: AdamParams, LoraConfig, SamplingParams, loss configs, engine configs and the
FSDP options all take numbers, and each had its own check with its own gaps (``inf``
accepted here, ``True`` accepted there). Here a number is a real, finite, non-bool value
within its bounds, and the message names the field and what was expected.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from typing import Any

from ..errors import InputError, quoted

#: an attrs field validator, as ``attrs.field(validator=...)`` calls it: (instance, attribute, value)
Validator = Callable[[Any, Any, Any], None]


def check_number(
    what: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    error: type[InputError] = InputError,
) -> Any:
    """Return ``value`` as a plain ``float`` (or ``int`` when ``integer``) or raise ``error``.

    Rejects bools, non-numbers, NaN and infinities; ``low``/``high`` are inclusive unless
    ``low_open``/``high_open``. numpy scalars are accepted and returned as Python numbers.
    The message names ``what``, the whole expectation (kind and bounds) and the value.
    """
    bounds = _bounds(low, high, low_open, high_open, integer)
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise error(f"{what}: expected {kind}{bounds}, got {quoted(value)}")
    try:  # an integer is finite however long (math.isfinite would overflow past 1e308)
        number = int(value) if integer and isinstance(value, numbers.Integral) else float(value)
    except OverflowError:  # an integer of 309+ digits as a float
        number = math.inf
    if not integer and not math.isfinite(number):
        raise error(f"{what}: expected {kind}{bounds}, got {quoted(value)}")
    if (low is not None and (number <= low if low_open else number < low)) or (
            high is not None and (number >= high if high_open else number > high)):
        raise error(f"{what}: expected {'an integer' if integer else 'a value'}{bounds}, got {quoted(value)}")
    return number


#: the text of an integer from a query string or a path: digits, an optional sign, at most 20
#: characters (int64's longest), so no 4300-digit string is ever converted
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]{1,19}")


def integer_from_text(what: str, text: str, *, low: int | None = None, high: int | None = None,
                      error: type[InputError] = InputError) -> int:
    """An integer written in a query string or a path (``"20"``, ``"-1"``), within ``low..high``
    (and int64), as :func:`check_number` words it. Decimals (``"20.0"``), underscores
    (``"1_000"``), exponents and anything longer than int64's longest are refused, never
    rounded or converted (Python's ``int()`` and the web framework's parsers accept some)."""
    low = INT64_MIN if low is None else max(low, INT64_MIN)
    high = INT64_MAX if high is None else min(high, INT64_MAX)
    stripped = text.strip()
    if not _INTEGER_TEXT.fullmatch(stripped):
        raise error(f"{what}: expected an integer in {low}..{high}, got {quoted(text)}")
    return check_number(what, int(stripped), low=low, high=high, integer=True, error=error)


#: Largest magnitude a loss-config number may have: bfloat16's largest finite value (float32's,
#: 3.4028e38, is a little larger), so the number is finite in either compute dtype.
TENSOR_MAX = 3.3895313892515355e38
#: Smallest nonzero magnitude: float32's (and bfloat16's) smallest normal; below it a number
#: becomes a subnormal or 0 in the tensor it multiplies.
TENSOR_TINY = 1.1754943508222875e-38
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_representable(what: str, value: Any, *, error: type[InputError] = InputError) -> None:
    """Refuse a number that a loss cannot hold in a float32/bfloat16 tensor (or an int64).

    Why: a loss config number meets the model's tensors only mid-compute, where torch raises
    a bare ``RuntimeError`` for ``1e308`` (overflow) and ``1e-300`` silently becomes 0. Non-numbers
    and bools are left to the config's own validators.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return
    if isinstance(value, numbers.Integral):
        if not INT64_MIN <= int(value) <= INT64_MAX:
            raise error(f"{what}: expected an integer that fits int64, got {value!r}")
        return
    number = float(value)
    if not math.isfinite(number):
        raise error(f"{what}: expected a finite number, got {value!r}")
    if abs(number) > TENSOR_MAX or (number != 0 and abs(number) < TENSOR_TINY):
        raise error(f"{what}: expected 0 or a magnitude in [{TENSOR_TINY:.6g}, {TENSOR_MAX:.6g}] (representable "
                    f"in float32 and bfloat16, the compute dtypes), got {value!r}")


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool, integer: bool) -> str:
    """`` in 1..8`` (closed integer ranges), else `` >= 0.0``, `` > 0.0 and <= 1.0``, or ``""``."""
    if integer and low is not None and high is not None and not (low_open or high_open):
        return f" in {low}..{high}"
    parts = [f"{'>' if low_open else '>='} {low}"] if low is not None else []
    parts += [f"{'<' if high_open else '<='} {high}"] if high is not None else []
    return " " + " and ".join(parts) if parts else ""


def number_validator(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    qualified: bool = False,
    error: type[InputError] = InputError,
) -> Validator:
    """An attrs validator applying :func:`check_number` to a field.

    Plugin authors use it on their loss config classes::

        @attrs.frozen
        class MyConfig:
            beta: float = attrs.field(default=0.1, validator=skyrl_sdk.number_validator(0.0))

    The message names the key (``beta: expected ...``), or ``ClassName.key`` when
    ``qualified`` (the public types, whose class name the caller typed).
    """

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        what = f"{type(instance).__name__}.{attribute.name}" if qualified else attribute.name
        check_number(what, value, low=low, high=high, low_open=low_open, high_open=high_open,
                     integer=integer, error=error)

    return validate


def to_float(value: Any) -> Any:
    """attrs converter for float fields: ints and numpy scalars become plain floats; anything
    else is left as it is for the validator to reject with the field's name."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past 1e308: left for the validator to refuse by name
            return value
    return value
