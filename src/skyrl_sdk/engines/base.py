"""The engine contract the Backend drives (the local and FSDP engines implement it).

An engine owns a model and its optimizer. The Backend validates and converts everything
*before* calling an engine, so an engine may assume well-formed input.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from ..losses.base import scores_key  # noqa: F401  (part of the engine API)
from ..losses.resolve import ResolvedLoss
from ..types import AdamParams, Datum, SampleOutput, SamplingParams


@attrs.frozen(eq=False)
class EngineResult:
    """Per-datum outputs (caller's order; name -> numpy array) and metric state."""

    outputs: list[dict[str, np.ndarray]]
    metric_state: dict[str, tuple[float, float]]


@attrs.frozen
class EngineInfo:
    model_name: str
    architecture: str
    vocab_size: int
    tokenizer_dir: str | None
    num_parameters: int
    num_trainable_parameters: int
    eos_token_id: int | None = None


@runtime_checkable
class Engine(Protocol):
    """What an engine provides. Paths given to save methods are fresh temporary
    directories that the Backend renames into place once the engine returns."""

    info: EngineInfo
    tokenizer: Any

    def run(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool) -> EngineResult:
        """Score ``data`` with ``loss``; with ``backward`` add the gradient of the summed loss."""

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale pending gradients, clip, AdamW-step, clear gradients; return metrics."""

    def zero_grad(self) -> None:
        """Drop pending gradients."""

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write weights + optimizer state into ``directory``; return metadata to record."""

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        """Load what :meth:`save_state` wrote (weights always, optimizer when asked)."""

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        """Write a Hugging Face model directory (config, safetensors, tokenizer)."""

    def sample(
        self, prompts: Sequence[np.ndarray], params: SamplingParams, num_samples: int, prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
    ) -> list[SampleOutput]:
        """Generate ``num_samples`` continuations per prompt from the current weights (the built-in
        ``transformers`` sampler calls this; ``topk_prompt_logprobs=k`` adds Tinker's top-k prompt logprobs)."""

    def close(self) -> None:
        """Free memory and processes."""
