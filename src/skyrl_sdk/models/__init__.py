"""Hugging Face models and their files: what every engine and the sampler build on.

- :mod:`.loading`: the built-in ``tiny`` model or a local HF directory, as a policy (causal
  LM) or a critic (backbone + :mod:`.value_head`), optionally with LoRA adapters;
- :mod:`.scoring`: the module engines run (backbone once, then target logprobs or values
  of the real tokens), with :mod:`.logprobs` (the fused, chunked log-softmax head);
- :mod:`.activation_checkpointing`: recompute each transformer block in backward;
- :mod:`.weight_files` (reading safetensors tensor by tensor or row slices) and
  :mod:`.checkpoint` (atomic, pickle-free saves of checkpoint directories).
"""

from __future__ import annotations

from .loading import TINY_NAME, LoadedModel, hf_model, load_config, load_model, load_tokenizer

__all__ = ["TINY_NAME", "LoadedModel", "hf_model", "load_config", "load_model", "load_tokenizer"]
