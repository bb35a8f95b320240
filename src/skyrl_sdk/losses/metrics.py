"""Metrics keyed ``name:reduction`` that reduce the same way whatever the micro-batching.

A loss reports a :class:`Metric` per key. ``:sum`` and ``:mean`` metrics carry a running
numerator (and, for means, a weight) so that combining micro-batches, calls or ranks gives
exactly the value one big batch would have given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs
import torch

REDUCTIONS = ("sum", "mean", "min", "max")


@attrs.frozen
class Metric:
    """One metric contribution. For ``:mean`` keys ``value`` is a sum and ``weight`` a count.

    ``value`` and ``weight`` are floats, or 0-d tensors still on the device (the helpers below
    return those): a micro-batch's metrics then cost no host sync; :meth:`MetricAccumulator.state`
    reads them all in one transfer at the end of the call."""

    value: float | torch.Tensor
    weight: float | torch.Tensor = 1.0


def check_metric_key(key: str) -> str:
    """Return the reduction of ``key``; raise if the key is not ``name:reduction``."""
    parts = key.split(":")
    if len(parts) != 2 or not parts[0] or parts[1] not in REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must have the form 'name:reduction' with exactly one colon "
            f"and reduction in {REDUCTIONS}"
        )
    return parts[1]


def _f(x: torch.Tensor | float) -> torch.Tensor | float:
    """A metric's number as it is: a detached 0-d tensor (read later, with the call's others) or a float."""
    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


def metric_sum(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:sum`` contribution: the (masked) sum of ``x``."""
    return Metric(_f((x * mask).sum() if mask is not None else x.sum()))


def metric_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:mean`` contribution over the (masked) elements of ``x``."""
    if mask is None:
        return Metric(_f(x.sum()), float(x.numel()))
    mask = mask.to(x.dtype)
    return Metric(_f((x * mask).sum()), _f(mask.sum()))


def _extreme(x: torch.Tensor, mask: torch.Tensor | None, empty: float, largest: bool) -> Metric:
    """The max (``largest``) or min over the elements where ``mask`` is true, with their count as
    weight; ``empty`` when there are none (no boolean indexing: that would wait for the device)."""
    if not x.numel():
        return Metric(empty, 0.0)
    if mask is None:
        return Metric(_f(x.max() if largest else x.min()), float(x.numel()))
    keep = mask.bool()
    picked = torch.where(keep, x, torch.full_like(x, empty))
    return Metric(_f(picked.max() if largest else picked.min()), _f(keep.sum()))


def metric_max(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:max`` contribution over the elements where ``mask`` is true."""
    return _extreme(x, mask, -math.inf, largest=True)


def metric_min(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:min`` contribution over the elements where ``mask`` is true."""
    return _extreme(x, mask, math.inf, largest=False)


def _combine(reduction: str, a: float | torch.Tensor, b: float | torch.Tensor) -> float | torch.Tensor:
    """Two values of one key combined (sums add; max / min pick), tensors kept on their device."""
    if reduction in ("sum", "mean"):
        return a + b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        pick = torch.maximum if reduction == "max" else torch.minimum
        device = next(x.device for x in (a, b) if isinstance(x, torch.Tensor))
        return pick(torch.as_tensor(a, dtype=torch.float64, device=device),
                    torch.as_tensor(b, dtype=torch.float64, device=device))
    return max(a, b) if reduction == "max" else min(a, b)


class MetricAccumulator:
    """Combines metric contributions from micro-batches, calls or ranks."""

    def __init__(self) -> None:
        self._values: dict[str, list] = {}

    def add(self, metrics: Mapping[str, Metric]) -> None:
        for key, metric in metrics.items():
            reduction = check_metric_key(key)
            value, weight = _f(metric.value), _f(metric.weight)
            if key not in self._values:
                self._values[key] = [value, weight]
                continue
            slot = self._values[key]
            slot[0] = _combine(reduction, slot[0], value)
            slot[1] = slot[1] + weight

    def state(self) -> dict[str, tuple[float, float]]:
        """Raw (value, weight) pairs, e.g. to send between ranks and merge with :meth:`merge`.
        Values still on a device are read here, in one transfer per device."""
        slots = {key: list(slot) for key, slot in self._values.items()}
        by_device: dict[torch.device, list[tuple[str, int]]] = {}
        for key, slot in slots.items():
            for i, v in enumerate(slot):
                if isinstance(v, torch.Tensor):
                    by_device.setdefault(v.device, []).append((key, i))
        for places in by_device.values():
            numbers = torch.stack([slots[k][i].reshape(()).to(torch.float64) for k, i in places]).cpu().tolist()
            for (key, i), number in zip(places, numbers, strict=True):
                slots[key][i] = number
        return {k: (float(v[0]), float(v[1])) for k, v in slots.items()}

    def merge(self, states: Iterable[Mapping[str, tuple[float, float]]]) -> None:
        for state in states:
            self.add({k: Metric(v, w) for k, (v, w) in state.items()})

    def result(self) -> dict[str, float]:
        out = {}
        for key, (value, weight) in self.state().items():
            if key.endswith(":mean"):
                out[key] = value / weight if weight > 0 else 0.0
            elif key.endswith((":max", ":min")) and weight == 0:
                out[key] = 0.0
            else:
                out[key] = value
        return out
