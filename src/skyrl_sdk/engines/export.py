"""Writing a Hugging Face model directory from a state dict (any engine).

The directory loads with ``AutoModelForCausalLM.from_pretrained`` (and vLLM) as is:
config, generation config, safetensors weights (sharded when large), tokenizer files.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..models.checkpoint import WEIGHTS_FILE, WEIGHTS_INDEX, dedupe_shared, write_hf_weights
from ..models.loading import hf_model

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer
    from transformers import PretrainedConfig

#: safetensors' dtype names.
_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

#: (name, shape, dtype) of a tensor to be written before its values exist.
TensorPlan = tuple[str, tuple[int, ...], torch.dtype]


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF model's own state dict (names as transformers saves them)."""
    return dict(hf_model(module).state_dict())


def merged_lora_state_dict(peft_module: torch.nn.Module,
                           state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
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
        adapters = layer.active_adapters
        state[f"{name}.weight"] = merge_lora_delta(
            layer, weight, {a: state[f"{name}.lora_A.{a}.weight"] for a in adapters},
            {a: state[f"{name}.lora_B.{a}.weight"] for a in adapters},
        )
        if f"{name}.base_layer.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return {k: v for k, v in state.items() if "lora_" not in k}


def save_peft_adapter(peft_module: Any, directory: str | Path, adapter: str | None = None) -> None:
    """peft's adapter files (``adapter`` alone, or every adapter), with ``save_embedding_layers``
    decided here rather than by peft's ``"auto"``, which warns on every such save and otherwise
    looks the base up for a resized vocabulary: the embedding layers' base weights go with the
    adapter exactly when LoRA wraps one (``lm_head`` with ``train_unembed``), as "auto" decides;
    skyrl-sdk never resizes a vocabulary."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    names = [adapter] if adapter is not None else list(peft_module.peft_config)
    targets = {t for name in names for t in (peft_module.peft_config[name].target_modules or ())}
    embedding_targeted = any(layer in targets for layer in EMBEDDING_LAYER_NAMES)
    peft_module.save_pretrained(str(directory), selected_adapters=names, save_embedding_layers=embedding_targeted)


def merge_lora_delta(layer: LoraLayer, weight: torch.Tensor, lora_a: dict, lora_b: dict) -> torch.Tensor:
    """``weight`` plus every active adapter's ``transpose(B @ A, fan_in_fan_out) * scaling``."""
    with torch.no_grad():
        for adapter in layer.active_adapters:
            delta = lora_b[adapter] @ lora_a[adapter]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            weight = weight + (delta * layer.scaling[adapter]).to(weight.dtype)
    return weight


def _nbytes(plan: TensorPlan) -> int:
    _, shape, dtype = plan
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


class SafetensorsStream:
    """One safetensors file written tensor by tensor: the header comes from the plan (names,
    shapes, dtypes), then each tensor's bytes as it arrives, so only one is ever in memory."""

    def __init__(self, file: Path, plan: Sequence[TensorPlan], metadata: dict[str, str] | None = None) -> None:
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, shape, dtype in plan:
            if dtype not in _DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
            size = _nbytes((name, shape, dtype))
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._plan = list(plan)
        self._next = 0
        self._fh = open(file, "wb")  # closed by close()
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)

    def write(self, tensor: torch.Tensor) -> None:
        name, shape, dtype = self._plan[self._next]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {tuple(shape)} {dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1)
        self._fh.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        self._fh.close()
        if self._next != len(self._plan):
            raise ValueError(f"{self._plan[self._next][0]}: the stream ended before every planned tensor")


def write_tensor_stream(file: Path, plan: Sequence[TensorPlan], tensors: Iterable[torch.Tensor],
                        metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (in ``plan``'s order) to one safetensors file, one at a time."""
    stream = SafetensorsStream(file, plan, metadata)
    try:
        for tensor in tensors:
            stream.write(tensor)
    finally:
        stream.close()


def write_hf_weights_stream(directory: Path, plan: Sequence[TensorPlan], tensors: Iterable[torch.Tensor],
                            max_shard_bytes: int) -> None:
    """HF-style weights (sharded above ``max_shard_bytes``, with an index), streamed: the
    same layout :func:`~skyrl_sdk.models.checkpoint.write_hf_weights` writes from a dict."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for item in plan:
        nbytes = _nbytes(item)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    it = iter(tensors)
    if len(shards) == 1:
        write_tensor_stream(directory / WEIGHTS_FILE, shards[0], (next(it) for _ in shards[0]), {"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_tensor_stream(directory / fname, shard, (next(it) for _ in shard), {"format": "pt"})
        weight_map.update({name: fname for name, _, _ in shard})
    index = {"metadata": {"total_size": sum(_nbytes(p) for p in plan)}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def lora_unties_head(model: torch.nn.Module, adapter: str | None = None) -> bool:
    """Whether a merged export must untie the embeddings: the config ties the input embedding
    and the output head, and LoRA adapts the head (``adapter``, or any adapter), so the merged
    head is no longer the embedding and both are written."""
    from peft.tuners.lora import LoraLayer

    inner = hf_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, LoraLayer) or not getattr(inner.config, "tie_word_embeddings", False):
        return False
    return adapter is None or adapter in head.lora_A


def write_hf_config(config: PretrainedConfig, tokenizer: Any, directory: Path, dtype: torch.dtype | None,
                    architecture: str | None, untie_embeddings: bool = False) -> None:
    """config.json (+ generation config, tokenizer) of an export, weights aside;
    ``untie_embeddings`` (:func:`lora_unties_head`) writes ``tie_word_embeddings: false``."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    if untie_embeddings:  # else a loader ties the merged head back to the embedding
        config.tie_word_embeddings = False
    if architecture:
        config.architectures = [architecture]
    config.use_cache = True  # inference-friendly; training forces use_cache=False itself
    if dtype is not None:
        config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(str(directory))
    try:
        GenerationConfig.from_model_config(config).save_pretrained(str(directory))
    except Exception:  # some configs carry no generation fields; the file is optional
        pass
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


def export_hf_directory(
    config: PretrainedConfig, state: dict[str, torch.Tensor], tokenizer: Any, directory: Path, max_shard_bytes: int,
    architecture: str | None = None, dtype: torch.dtype | None = None, image_processor: Any = None,
    untie_embeddings: bool = False,
) -> None:
    """Write ``state`` as a model directory; ``dtype`` (the engine's compute dtype) casts
    every floating tensor, so a bf16-mixed run exports bf16 weights, not its fp32 masters. A
    vision-language model's ``image_processor`` is saved too (its pixel bounds decide how many
    positions an image takes)."""
    state, _ = dedupe_shared(state)  # tied embeddings: keep the first name only
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    write_hf_config(config, None, directory, next(iter(dtypes)) if len(dtypes) == 1 else None, architecture,
                    untie_embeddings)
    write_hf_weights(state, directory, max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    if image_processor is not None:
        image_processor.save_pretrained(str(directory))


def base_state_dict(peft_module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights under a peft wrapper, named as the plain model names them, with no
    adapter merged (every ``lora_*`` tensor left out): what a LoRA sampler starts from."""
    from peft.tuners.lora import LoraLayer

    inner = hf_model(peft_module)
    state = {k: v for k, v in inner.state_dict().items() if "lora_" not in k}
    for name, layer in inner.named_modules():
        if isinstance(layer, LoraLayer):
            for leaf in ("weight", "bias"):
                if f"{name}.base_layer.{leaf}" in state:
                    state[f"{name}.{leaf}"] = state.pop(f"{name}.base_layer.{leaf}")
    return state
