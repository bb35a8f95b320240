"""What runs inside vLLM's worker (``LLM.collective_rpc``): loading weights in place and adding
LoRA adapters from tensors. The worker is in this process (``loading``), so the tensors are
passed by reference.

These use vLLM's own loading paths: ``Worker.reload_weights`` (the layer-wise in-place reload
vLLM provides for RL weight updates: each layer's kernel format, such as the CPU backend's
packed GEMM weights, is rebuilt into the same storage) and, for adapters, what
``WorkerLoRAManager`` does with an adapter read from disk (``PEFTHelper``, validation,
``LoRAModel.from_lora_tensors``), fed from memory instead.
"""

from __future__ import annotations

from typing import Any

import torch


def load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Copy ``weights`` (Hugging Face names) into the running model, in place."""
    worker.reload_weights(weights_iterator=iter(weights))


def _lora_manager(worker: Any) -> Any:
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM engine was started without LoRA (enable_lora)")
    return manager


def add_adapter(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Register an adapter from ``tensors`` (peft's file names) under ``lora_id``, replacing any
    adapter of that id, as vLLM registers one it read from disk."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _lora_manager(worker)
    models = manager._adapter_manager  # vLLM has no public "add from tensors"; its disk path does the same
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = models.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    models.remove_adapter(lora_id)
    models.add_adapter(lora)


def loaded_adapters(worker: Any) -> set[int]:
    """The ids of the adapters vLLM holds (its LRU may have dropped some)."""
    return set(_lora_manager(worker).list_adapters())


def remove_adapter(worker: Any, lora_id: int) -> bool:
    return bool(_lora_manager(worker).remove_adapter(lora_id))
