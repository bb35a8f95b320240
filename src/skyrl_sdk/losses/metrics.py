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
    """One metric contribution. For ``:mean`` keys ``value`` is a sum and ``weight`` a count."""

    value: float
    weight: float = 1.0


def check_metric_key(key: str) -> str:
    """Return the reduction of ``key``; raise if the key is not ``name:reduction``."""
    parts = key.split(":")
    if len(parts) != 2 or not parts[0] or parts[1] not in REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must have the form 'name:reduction' with exactly one colon "
            f"and reduction in {REDUCTIONS}"
        )
    return parts[1]


def _f(x: torch.Tensor | float) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


def metric_sum(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:sum`` contribution: the (masked) sum of ``x``."""
    return Metric(_f((x * mask).sum() if mask is not None else x.sum()))


def metric_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:mean`` contribution over the (masked) elements of ``x``."""
    if mask is None:
        return Metric(_f(x.sum()), float(x.numel()))
    mask = mask.to(x.dtype)
    return Metric(_f((x * mask).sum()), _f(mask.sum()))


def metric_max(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:max`` contribution over the elements where ``mask`` is true."""
    if mask is not None:
        x = x[mask.bool()]
    return Metric(_f(x.max()) if x.numel() else -math.inf, float(x.numel()))


def metric_min(x: torch.Tensor, mask: torch.Tensor | None = None) -> Metric:
    """A ``:min`` contribution over the elements where ``mask`` is true."""
    if mask is not None:
        x = x[mask.bool()]
    return Metric(_f(x.min()) if x.numel() else math.inf, float(x.numel()))


class MetricAccumulator:
    """Combines metric contributions from micro-batches, calls or ranks."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}

    def add(self, metrics: Mapping[str, Metric]) -> None:
        for key, metric in metrics.items():
            reduction = check_metric_key(key)
            value, weight = float(metric.value), float(metric.weight)
            if key not in self._values:
                self._values[key] = [value, weight]
                continue
            slot = self._values[key]
            if reduction in ("sum", "mean"):
                slot[0] += value
                slot[1] += weight
            elif reduction == "max":
                slot[0] = max(slot[0], value)
                slot[1] += weight
            else:
                slot[0] = min(slot[0], value)
                slot[1] += weight

    def state(self) -> dict[str, tuple[float, float]]:
        """Raw (value, weight) pairs, e.g. to send between ranks and merge with :meth:`merge`."""
        return {k: (v[0], v[1]) for k, v in self._values.items()}

    def merge(self, states: Iterable[Mapping[str, tuple[float, float]]]) -> None:
        for state in states:
            self.add({k: Metric(v, w) for k, (v, w) in state.items()})

    def result(self) -> dict[str, float]:
        out = {}
        for key, (value, weight) in self._values.items():
            if key.endswith(":mean"):
                out[key] = value / weight if weight > 0 else 0.0
            elif key.endswith((":max", ":min")) and weight == 0:
                out[key] = 0.0
            else:
                out[key] = value
        return out
