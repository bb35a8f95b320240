"""What each call achieved: tokens per second, and MFU where the device's peak is known.

Every ``forward_backward`` / ``forward`` output's metrics, and every ``sample`` output's, carry
``tokens_per_second:mean`` and ``seconds:sum`` (the engine's or the sampler's wall time of the
call), and ``mfu:mean`` when the device's peak is known: the model FLOPs of the call over the
seconds, divided by the peak (``engine_config["peak_tflops"]``, else :data:`PEAK_TFLOPS` by the
GPU's name; none on CPU). The ``:mean`` / ``:sum`` suffixes are how Tinker's client combines the
metrics of a batch it sent in chunks ("mfu:mean" is its own example).

**Model FLOPs** (:func:`forward_flops`), per datum of ``T`` tokens: ``2 N T`` for the matmuls
(``N``: the parameters a token passes through, the input embedding excluded unless it is also
the output head) plus ``2 L d T (T + 1)`` for causal attention (each token attends to itself
and the ones before it: ``4 d`` FLOPs per pair per layer, ``d`` = heads x head dim, ``L``
layers). Training counts 3x the forward (weight and input gradients), LoRA 2x (a frozen weight
needs no weight gradient), ``forward`` 1x. Recomputation (gradient checkpointing) is not
counted: MFU is *model* FLOPs utilisation. A sample counts each prompt once and each sampled
token once at its context length.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..models.vlm import text_config
from ..types import ModelInput

if TYPE_CHECKING:
    import numpy as np

    from ..types import Datum, SampleOutput
    from .base import Engine

#: Dense (no sparsity) peak TFLOP/s of one GPU by compute dtype, from NVIDIA's datasheets: bf16
#: on tensor cores; float32 without TF32 (torch's default matmul precision). The first name found
#: as a word in ``torch.cuda.get_device_name()`` wins, so the longer names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bfloat16": 756.0, "float32": 51.2}),
    ("H100 NVL", {"bfloat16": 835.0, "float32": 60.0}),
    ("H200 NVL", {"bfloat16": 835.0, "float32": 60.0}),
    ("GH200", {"bfloat16": 989.4, "float32": 66.9}),
    ("H200", {"bfloat16": 989.4, "float32": 66.9}),
    ("H100", {"bfloat16": 989.4, "float32": 66.9}),
    ("H800", {"bfloat16": 989.4, "float32": 66.9}),
    ("A100", {"bfloat16": 312.0, "float32": 19.5}),
    ("A800", {"bfloat16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.05, "float32": 91.6}),
    ("L4", {"bfloat16": 121.0, "float32": 30.3}),
    ("B200", {"bfloat16": 2250.0}),
)
#: what the metrics of one call are called (tests that compare two runs' loss metrics drop them)
THROUGHPUT_KEYS = ("tokens_per_second:mean", "mfu:mean", "seconds:sum", "sampled_tokens:sum", "prompt_tokens:sum")
#: backward's FLOPs over forward's, by what trains
BACKWARD_FACTOR = {"full": 3.0, "lora": 2.0, "forward": 1.0}


def table_peak_tflops(device_name: str, dtype: str) -> float | None:
    """The table's peak for a GPU named ``device_name`` in ``dtype``, or None (not listed)."""
    for name, peaks in PEAK_TFLOPS:
        if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", device_name):
            return peaks.get(dtype)
    return None


def peak_flops(device_type: str, device_name: str | None, dtype: str, override_tflops: float | None = None,
               devices: int = 1) -> float | None:
    """FLOP/s of ``devices`` devices at their peak in ``dtype``: the override when given, else the
    table for a CUDA device, else None (CPU: no figure worth dividing by). A pure function: tests
    drive the CUDA branch on any machine."""
    tflops = override_tflops
    if tflops is None and device_type == "cuda" and device_name:
        tflops = table_peak_tflops(device_name, dtype)
    return None if tflops is None else float(tflops) * 1e12 * devices


def cuda_name(device_type: str, index: int | None = None) -> str | None:
    """``torch.cuda.get_device_name`` of a CUDA device (None for any other device)."""
    if device_type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(index)


def without_throughput(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` less the timing figures (what two runs of the same call can be compared on)."""
    return {k: v for k, v in metrics.items() if k not in THROUGHPUT_KEYS}


@attrs.frozen
class ModelShape:
    """What the FLOP count needs of a model (see the module docstring)."""

    matmul_parameters: int
    layers: int
    attention_width: int

    @classmethod
    def of(cls, num_parameters: int, hf_config: object) -> ModelShape:
        """From the parameter count and the model's (text) config; a config without the usual
        fields counts matmuls only."""
        config = text_config(hf_config)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        lookup = 0 if tied else hidden * vocab  # an untied input embedding is a lookup: no FLOPs
        return cls(matmul_parameters=max(0, int(num_parameters) - lookup), layers=layers,
                   attention_width=heads * head_dim)

    def forward_flops(self, lengths: Iterable[int]) -> float:
        """Model FLOPs of one forward over datums of these lengths."""
        total = 0.0
        for t in lengths:
            total += 2.0 * self.matmul_parameters * t + 2.0 * self.layers * self.attention_width * t * (t + 1)
        return total

    def sample_flops(self, prompt_lengths: Sequence[int], sampled: Sequence[Sequence[int]]) -> float:
        """Model FLOPs of a sample call: each prompt once, then each sampled token of each of its
        sequences (``sampled[i]``: their lengths) at its context length."""
        total = self.forward_flops(prompt_lengths)
        for p, lengths in zip(prompt_lengths, sampled, strict=True):
            for g in lengths:
                total += 2.0 * self.matmul_parameters * g + 4.0 * self.layers * self.attention_width * (
                    g * p + g * (g + 1) / 2)
        return total


def call_metrics(tokens: float, seconds: float, flops: float, peak: float | None) -> dict[str, float]:
    """The throughput metrics of one call (``mfu:mean`` only with a peak)."""
    seconds = max(float(seconds), 1e-9)
    out = {"tokens_per_second:mean": float(tokens) / seconds, "seconds:sum": seconds}
    if peak:
        out["mfu:mean"] = float(flops) / seconds / peak
    return out


class CallClock:
    """A Backend's call timings as metrics: its engine's model shape and peak, found at the first
    call (the model's config is read then; a model whose config cannot be read counts matmuls
    only, from the parameter count)."""

    def __init__(self, engine: Engine, *, lora: bool) -> None:
        self.engine = engine
        self.lora = lora
        self._model: tuple[ModelShape, float | None] | None = None

    def _shape_and_peak(self) -> tuple[ModelShape, float | None]:
        if self._model is None:
            info = self.engine.info
            try:
                from ..models.loading import load_config

                config, _ = load_config(info.model_name)
            except Exception:  # a custom engine's model name need not be a directory we can read
                config = None
            self._model = (ModelShape.of(info.num_parameters, config), self.engine.peak_flops())
        return self._model

    def training(self, datums: Sequence[Datum], seconds: float, *, backward: bool) -> dict[str, float]:
        """Metrics of a ``forward_backward`` (``backward``) or ``forward`` over ``datums``."""
        shape, peak = self._shape_and_peak()
        lengths = [d.model_input.length for d in datums]
        factor = BACKWARD_FACTOR[("lora" if self.lora else "full") if backward else "forward"]
        return call_metrics(sum(lengths), seconds, factor * shape.forward_flops(lengths), peak)

    def sampling(self, prompts: Sequence[np.ndarray | ModelInput], outputs: Sequence[SampleOutput],
                 seconds: float) -> dict[str, float]:
        """Metrics of a ``sample`` call: tokens per second are the sampled tokens'."""
        shape, peak = self._shape_and_peak()
        # token arrays or ModelInputs; a sampler that answered for fewer prompts is counted as it answered
        prompt_lengths = [p.length if isinstance(p, ModelInput) else len(p) for p in prompts][:len(outputs)]
        sampled = [[len(s.tokens) for s in out.sequences] for out in outputs][:len(prompt_lengths)]
        tokens = sum(sum(lengths) for lengths in sampled)
        metrics = call_metrics(tokens, seconds, shape.sample_flops(prompt_lengths, sampled), peak)
        metrics.update({"sampled_tokens:sum": float(tokens), "prompt_tokens:sum": float(sum(prompt_lengths))})
        return metrics

    def timed_sample(self, sampler: Any, request: Any) -> list[Any]:
        """``sampler.sample(request)``, each output with the call's :meth:`sampling` metrics."""
        t0 = time.perf_counter()
        outputs = sampler.sample(request)
        metrics = self.sampling(request.prompts, outputs, time.perf_counter() - t0)
        return [attrs.evolve(o, metrics=metrics) for o in outputs]
