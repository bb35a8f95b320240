"""Writing a Hugging Face model directory from a state dict (any engine).

The directory loads with ``AutoModelForCausalLM.from_pretrained`` (and vLLM) as is:
config, generation config, safetensors weights (sharded when large), tokenizer files.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..checkpoint import dedupe_shared, write_hf_weights
from ..models import hf_model


def full_state_dict(module) -> dict[str, torch.Tensor]:
    """The HF model's own state dict (names as transformers saves them)."""
    return dict(hf_model(module).state_dict())


def merged_lora_state_dict(peft_module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Base weights with every LoRA delta merged in, without touching the live model.

    ``state`` is a full state dict of ``hf_model(peft_module)`` (the FSDP engine passes the
    gathered one; by default the module's own). The delta is peft's
    ``transpose(B @ A, fan_in_fan_out) * scaling``, computed from ``state`` itself.
    """
    from peft.tuners.lora import LoraLayer

    state = dict(hf_model(peft_module).state_dict() if state is None else state)
    for name, layer in hf_model(peft_module).named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        weight = state.pop(f"{name}.base_layer.weight")
        with torch.no_grad():
            for adapter in layer.active_adapters:
                delta = state[f"{name}.lora_B.{adapter}.weight"] @ state[f"{name}.lora_A.{adapter}.weight"]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                weight = weight + (delta * layer.scaling[adapter]).to(weight.dtype)
        state[f"{name}.weight"] = weight
        if f"{name}.base_layer.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return {k: v for k, v in state.items() if "lora_" not in k}


def export_hf_directory(
    config, state: dict[str, torch.Tensor], tokenizer, directory: Path, max_shard_bytes: int,
    architecture: str | None = None, dtype: torch.dtype | None = None,
) -> None:
    """Write ``state`` as a model directory; ``dtype`` (the engine's compute dtype) casts
    every floating tensor, so a bf16-mixed run exports bf16 weights, not its fp32 masters."""
    from transformers import GenerationConfig

    state, _ = dedupe_shared(state)  # tied embeddings: keep the first name only
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    config = copy.deepcopy(config)
    if architecture:
        config.architectures = [architecture]
    config.use_cache = True  # inference-friendly; training forces use_cache=False itself
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = str(next(iter(dtypes))).replace("torch.", "")
    config.save_pretrained(str(directory))
    try:
        GenerationConfig.from_model_config(config).save_pretrained(str(directory))
    except Exception:  # some configs carry no generation fields; the file is optional
        pass
    write_hf_weights(state, directory, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
