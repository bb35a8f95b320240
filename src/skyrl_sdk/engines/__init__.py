"""Execution engines: what runs a call on a model (see docs/engines.md).

The engine authors' API is this package's ``__all__``: the :class:`Engine` base class and
what it returns, the typed ``engine_config``, the micro-batch loop (:class:`ModelRunner`),
the assembly helpers and the built-in ``local`` engine. The building blocks an engine may
also use live in their own layers and are listed in docs/engines.md: models and their files
in :mod:`skyrl_sdk.models`, saved-state checks in :mod:`.state`, exports in :mod:`.export`,
calls as plain data (for multi-process engines) in :mod:`.plain`.
"""

from ..losses.resolve import ResolvedLoss
from .base import Engine, EngineInfo, EngineResult, image_inputs, runner_options, scores_key, scoring_model
from .config import EngineConfig
from .local import LocalEngine
from .runner import ModelRunner

__all__ = [
    "Engine", "EngineInfo", "EngineResult", "EngineConfig", "ResolvedLoss", "scores_key",
    "ModelRunner", "scoring_model", "runner_options", "image_inputs", "LocalEngine",
]
