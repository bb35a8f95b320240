"""Execution engines: run the model, compute target logprobs, backprop, step the optimizer.

This package is the API for engine authors (see docs/engines.md): everything an engine
plugin needs is importable from ``skyrl_sdk.engines``; the modules behind it are internal.
"""

from ..checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, dedupe_shared, load_tensors, save_tensors
from ..logprobs import FUSED_METHOD, fusable_linear, linear_target_logprobs
from ..losses.resolve import ResolvedLoss
from ..metrics import MetricAccumulator
from ..models import TINY_NAME, LoadedModel, hf_model, load_model, load_tokenizer
from ..weight_files import read_rows, tensor_shapes, weight_files
from .activation_checkpointing import enable_activation_checkpointing, transformer_blocks
from .base import Engine, EngineInfo, EngineResult, scores_key
from .config import EngineConfig
from .export import (
    TensorPlan,
    export_hf_directory,
    full_state_dict,
    merge_lora_delta,
    merged_lora_state_dict,
    write_hf_config,
    write_hf_weights_stream,
    write_tensor_stream,
)
from .local import LocalEngine
from .modules import ScoringModel, count_parameters
from .plain import datums_from_plain, datums_to_plain, loss_from_plain, loss_to_plain
from .runner import ModelRunner
from .state import CheckedState, StateLayout, TensorSpec, check_engine_metadata, check_state_files

__all__ = [
    # the contract
    "Engine", "EngineInfo", "EngineResult", "EngineConfig", "ResolvedLoss", "scores_key",
    # building blocks
    "LoadedModel", "load_model", "load_tokenizer", "hf_model", "ScoringModel", "ModelRunner",
    "MetricAccumulator", "count_parameters", "generate",
    # the built-in engine, to subclass when one step should differ
    "LocalEngine",
    # the fused head, for engines that wrap the output projection (e.g. an FSDP2 unit)
    "FUSED_METHOD", "fusable_linear", "linear_target_logprobs",
    # memory: activation checkpointing per transformer block
    "transformer_blocks", "enable_activation_checkpointing",
    # multi-process engines: calls as plain data
    "loss_to_plain", "loss_from_plain", "datums_to_plain", "datums_from_plain",
    # checkpoints and exports
    "WEIGHTS_FILE", "OPTIMIZER_FILE", "save_tensors", "load_tensors", "dedupe_shared",
    "StateLayout", "TensorSpec", "CheckedState", "check_state_files", "check_engine_metadata",
    "export_hf_directory", "full_state_dict", "merged_lora_state_dict",
    # streaming (one tensor at a time) exports and sliced loading, for sharded engines
    "TensorPlan", "merge_lora_delta", "write_hf_config", "write_hf_weights_stream", "write_tensor_stream",
    "TINY_NAME", "weight_files", "read_rows", "tensor_shapes",
]


def __getattr__(name: str):
    # The sampler's decode loop imports engines.modules (the scoring head), so it is resolved
    # on first use rather than at import (which would be circular).
    if name == "generate":
        from ..sampling import generate

        return generate
    raise AttributeError(f"module 'skyrl_sdk.engines' has no attribute {name!r}")
