"""Deprecated import path of :mod:`skyrl_sdk.dialects.tinker`; removed in skyrl-sdk 0.3."""

from __future__ import annotations

import warnings

from ..dialects.tinker import convert_tinker, convert_tinker_loss_config

warnings.warn(
    "skyrl_sdk.converters.tinker moved to skyrl_sdk.dialects.tinker; the old path goes away in skyrl-sdk 0.3",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["convert_tinker", "convert_tinker_loss_config"]
