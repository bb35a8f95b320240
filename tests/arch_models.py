"""Tiny random models of other Hugging Face families (hidden 64, 2 layers), written as HF
directories with the built-in tiny tokenizer beside them (shared by the architecture tests)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
              pad_token_id=258)

#: family -> (config class name, extra config fields)
FAMILIES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False)),
    # logit soft-capping on the output (and attention), tied embeddings
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                                    attn_logit_softcapping=50.0, sliding_window=8)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                             final_logit_softcapping=30.0)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
}


def make_family_dir(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Build ``family``'s tiny config (with ``overrides`` of its fields) with random weights and
    save it (config, weights, tokenizer)."""
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from skyrl_sdk.models.loading import TINY_DIR
    from skyrl_sdk.models.tiny_vlm import perturb_norms

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    perturb_norms(model)
    model.save_pretrained(str(path))
    PreTrainedTokenizerFast.from_pretrained(str(TINY_DIR)).save_pretrained(str(path))
    return path
