"""skyrl-sdk: turn any Hugging Face causal LM into a Tinker-compatible training backend.

Everything a loss-plugin author needs is importable from here::

    from skyrl_sdk import LossInput, LossOutput, Register, hookimpl, metric_sum, segment_mean

Engine authors use :mod:`skyrl_sdk.engines`; callers use :class:`Backend` and
:mod:`skyrl_sdk.types`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import errors, types
from .hooks import Register, hookimpl, register_dialect, register_engine, register_loss, register_sampler
from .types.numbers import number_validator
from .version import __version__

if TYPE_CHECKING:  # the lazy names' own types for a type checker (at run time __getattr__ imports them)
    from .backend import Backend
    from .builtin_plugins import get_plugins, get_registry
    from .evaluate import evaluate_loss
    from .losses import (
        LossInput,
        LossOutput,
        LossSpec,
        Metric,
        metric_max,
        metric_mean,
        metric_min,
        metric_sum,
        safe_ratio,
        segment_mean,
        segment_sum,
    )
    from .shared_base import SharedBase

#: Names that pull in torch, resolved on first use so ``import skyrl_sdk`` stays cheap.
_LAZY = {
    "Backend": "backend",
    "SharedBase": "shared_base",
    "LossInput": "losses",
    "LossOutput": "losses",
    "LossSpec": "losses",
    "evaluate_loss": "evaluate",
    "get_plugins": "builtin_plugins",
    "get_registry": "builtin_plugins",
    "safe_ratio": "losses",
    "segment_mean": "losses",
    "segment_sum": "losses",
    "Metric": "losses",
    "metric_max": "losses",
    "metric_mean": "losses",
    "metric_min": "losses",
    "metric_sum": "losses",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'skyrl_sdk' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Backend",
    "Register",
    "LossInput",
    "LossOutput",
    "LossSpec",
    "Metric",
    "SharedBase",
    "__version__",
    "errors",
    "evaluate_loss",
    "get_plugins",
    "get_registry",
    "hookimpl",
    "metric_max",
    "metric_mean",
    "metric_min",
    "metric_sum",
    "number_validator",
    "register_dialect",
    "register_engine",
    "register_loss",
    "register_sampler",
    "safe_ratio",
    "segment_mean",
    "segment_sum",
    "types",
]
