"""Typed, frozen objects that every skyrl-sdk call takes or returns.

They mirror the official ``tinker.types`` (same field names and defaults) so code written
against Tinker reads the same here: one small module per kind of type, every field
documented. Tensors are numpy-backed (:class:`TensorData`): no per-element Python loops.
"""

from __future__ import annotations

from .arrays import TensorDtype, densify_csr
from .datum import Datum
from .model_input import EncodedTextChunk, ImageChunk, ModelInput, PreparedImageChunk
from .outputs import (
    ForwardBackwardOutput,
    LoadStateOutput,
    ModelInfo,
    OptimStepOutput,
    PromptAltTokens,
    SampledSequence,
    SampleOutput,
    SaveStateOutput,
    SaveWeightsForSamplerOutput,
)
from .params import MIN_ADAM_EPS, AdamParams, LoraConfig, SamplingParams
from .provenance import PromptProvenanceSpan, ProvenanceSpan, SampledProvenanceSpan
from .sample_request import SampleRequest
from .tensor import INTEGER_KEYS, TensorData, dtype_for_key, to_tensor_data

__all__ = [
    "INTEGER_KEYS",
    "MIN_ADAM_EPS",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ImageChunk",
    "LoadStateOutput",
    "LoraConfig",
    "ModelInfo",
    "ModelInput",
    "OptimStepOutput",
    "PreparedImageChunk",
    "PromptAltTokens",
    "PromptProvenanceSpan",
    "ProvenanceSpan",
    "SampleOutput",
    "SampleRequest",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingParams",
    "SaveStateOutput",
    "SaveWeightsForSamplerOutput",
    "TensorData",
    "TensorDtype",
    "densify_csr",
    "dtype_for_key",
    "to_tensor_data",
]
