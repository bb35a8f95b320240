"""Tiny random vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), built offline.

A directory written here is what a real checkpoint holds, at toy size: ``config.json`` and
safetensors weights from the family's config classes (seeded), a byte-level tokenizer with
Qwen's chat and vision markers (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>``...)
and the image processor's ``preprocessor_config.json``. Nothing is downloaded: tests, docs
and the cookbook's ``vlm_classifier`` recipe run against it.

It needs Pillow (the image processor; the ``vision`` extra), not pytest: import it from here
(``skyrl_sdk.testing`` re-exports it for tests). What it needs is checked before anything is
written, and the directory appears whole or not at all (written beside it, then renamed): a
half-written one, without its image processor's settings, would load with the family's
defaults and wrong image sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelLoadError, install_hint
from .checkpoint import atomic_directory
from .loading import build_tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

#: Qwen's chat and vision markers, ids 256.. after the 256 bytes.
VLM_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                      "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
TOKEN_IDS = {tok: 256 + i for i, tok in enumerate(VLM_SPECIAL_TOKENS)}
VOCAB_SIZE = 320
#: The image processor keeps images between these pixel counts (a 56 x 56 image is 4 tokens
#: with 14-pixel patches; the largest, 112 x 112, 16): small rows, real processing.
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112

_TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
             eos_token_id=TOKEN_IDS["<|im_end|>"], pad_token_id=TOKEN_IDS["<|endoftext|>"], bos_token_id=None)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # head_dim 16: 2+3+3 = 8 pairs

#: family -> (config class, text config fields, vision config fields)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": ("Qwen2VLConfig", dict(rope_parameters=_ROPE),
                 dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(rope_parameters=_ROPE),
                   dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                        fullatt_block_indexes=[1])),
    "qwen3_vl": ("Qwen3VLConfig", dict(head_dim=16, rope_parameters={**_ROPE, "mrope_interleaved": True}),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])),
}


def tiny_vlm_config(family: str = "qwen2_vl") -> PretrainedConfig:
    """The family's config at toy size (hidden 64, 2 layers; a 2-block vision tower)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    cls_name, text, vision = FAMILIES[family]
    return getattr(transformers, cls_name)(
        text_config={**_TEXT, **text}, vision_config=vision, tie_word_embeddings=False,
        image_token_id=TOKEN_IDS["<|image_pad|>"], video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"], vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
    )


def tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with Qwen's markers; ``<|im_end|>`` ends a turn (EOS)."""
    return build_tiny_tokenizer(VLM_SPECIAL_TOKENS, bos=None, eos="<|im_end|>", pad="<|endoftext|>")


def tiny_image_processor(config: PretrainedConfig) -> Qwen2VLImageProcessorPil:
    """Qwen's image processor (the PIL one: no torchvision) for ``config``'s vision tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def perturb_norms(model: torch.nn.Module, scale: float = 0.1) -> None:
    """Norm weights start at exactly 1 (or 0): move them (seeded by the caller) so that a test
    loading them checks they are really loaded."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(scale * torch.randn_like(p))


def check_requirements() -> None:
    """What :func:`make_tiny_vlm` needs, before it writes anything: Pillow (the image processor)."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ModelLoadError(f"make_tiny_vlm needs Pillow (the image processor reads and saves with it): "
                             f"{install_hint('vision')}") from None


def make_tiny_vlm(path: str | Path, family: str = "qwen2_vl", seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write a tiny random ``family`` model directory at ``path`` (config, weights, tokenizer,
    image processor) and return it; the same seed gives the same weights. The directory
    appears whole or not at all; ``overwrite`` replaces one this function wrote before.
    Needs Pillow (:func:`check_requirements`), not pytest."""
    from transformers import AutoModelForImageTextToText

    check_requirements()
    path = Path(path)
    config = tiny_vlm_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
        perturb_norms(model)
    processor = tiny_image_processor(config)
    with atomic_directory(path, overwrite=overwrite) as tmp:
        model.save_pretrained(str(tmp))
        tiny_vlm_tokenizer().save_pretrained(str(tmp))
        processor.save_pretrained(str(tmp))
    return path
