"""Typed engine_config shared by the built-in engines (unknown keys are an error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..errors import InputError, did_you_mean
from ..models.attention import DEFAULT_ATTN_IMPLEMENTATION, PREFIX_SHARING_KERNELS, check_name
from ..types.numbers import check_number, to_float
from .batching import Layout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Compute dtypes the engines run. float16 would need a dynamic loss scaler (its 5-bit
#: exponent underflows small gradients); bfloat16 has float32's range and needs none.
_COMPUTE_DTYPES = ("float32", "bfloat16")


def _positive(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    check_number(f"engine_config[{attribute.name!r}]", value, low=1, integer=True)


def _positive_seconds(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    check_number(f"engine_config[{attribute.name!r}]", value, low=0.0, low_open=True)


def _bool(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InputError(f"engine_config[{attribute.name!r}]: expected true or false, got {value!r}")


def _bool_or_none(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise InputError(f"engine_config[{attribute.name!r}]: expected true, false or null, got {value!r}")


def _peak(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        check_number(f"engine_config[{attribute.name!r}] (TFLOP/s of one device)", value, low=0.0, low_open=True)


@attrs.frozen
class EngineConfig:
    """Options every built-in engine understands.

    - ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1", ...
    - ``dtype``: the *compute* dtype, "float32" (default) or "bfloat16" (matmuls in bf16;
      master weights, gradients and AdamW moments stay float32: mixed precision).
    - ``master_dtype``: dtype of the stored weights, gradients and AdamW moments:
      "float32" (default) or, only with ``dtype="bfloat16"``, "bfloat16" (pure bf16: half
      the memory, but updates smaller than a weight's bf16 spacing round away: lossy).
    - ``gradient_checkpointing``: recompute each transformer block in backward instead of
      keeping its activations (less memory, ~one more forward of compute).
    - ``micro_batch_tokens``: token budget of one micro-batch (padded tokens for buckets).
    - ``batching``: "bucket" (length-sorted, padded) or "pack" (one packed row).
    - ``attn_implementation``: the attention kernel (``models/attention.py``): "sdpa"
      (the default: None leaves it to transformers, which picks "sdpa", or "eager" for the few
      families without it), "eager", "flash_attention_2", "flash_attention_3" or
      "flex_attention"; one that cannot run on the device is refused by name when the engine
      is built.
    - ``prefix_sharing``: datums of one call that start with the same tokens (an RL group's
      prompt) are computed with that head once (exact; docs/engines.md). Default (None): on
      where the attention kernel takes it ("sdpa", "eager"); True with another kernel is refused.
    - ``prefix_sharing_min_tokens``: the shortest common head worth sharing.
    - ``logprob_chunk_elements``: tokens x vocab above which logprobs are chunked.
    - ``world_size``: ranks (FSDP engine only).
    - ``max_shard_bytes``: largest safetensors shard of an exported model.
    - ``keep_grads_on_error``: a ``forward_backward`` that fails mid-call leaves the pending
      gradients as they were (default), at the cost of one more gradient buffer while a call
      runs on top of pending gradients; False: no extra buffer, such a failure drops them all.
    - ``offload_while_sampling``: while a sampler with its own copy of the weights (vllm)
      samples, the trainer's parameters, gradients and AdamW state wait in host memory; they
      come back before the next call that computes (docs/engines.md, Colocated memory).
    - ``peak_tflops``: the device's peak TFLOP/s in the compute dtype, for the MFU metric
      (default: the table in ``engines/throughput.py``, by GPU name; none on CPU).
    - ``train_vision_tower``: a vision-language model's vision tower trains too (LoRA adapters
      in it, or its weights under full fine-tuning); default frozen.
    - ``max_image_pixels``: the most pixels (width x height) of one image, read from its header
      before it is decoded.
    - ``max_image_tokens_per_datum`` / ``max_image_tokens_per_call``: the most positions the
      images of one datum (or prompt) / of one call take; refused before any compute.
    - ``max_image_pixels_per_call``: the most pixels the distinct images of one call have
      together (their decoding work), read from their headers.
    - ``max_jpeg_scans``: the most scans one JPEG may have (each is a pass over every pixel).
    - ``max_image_decode_s``: seconds one image's decoding may take; past it the call is refused.
    """

    device: str = "auto"
    dtype: str = "float32"
    master_dtype: str = "float32"
    gradient_checkpointing: bool = attrs.field(default=False, validator=_bool)
    micro_batch_tokens: int = attrs.field(default=8192, validator=_positive)
    batching: Layout = "bucket"
    attn_implementation: str | None = attrs.field(default=DEFAULT_ATTN_IMPLEMENTATION,
                                           validator=lambda i, a, v: check_name(v))
    prefix_sharing: bool | None = attrs.field(default=None, validator=_bool_or_none)
    prefix_sharing_min_tokens: int = attrs.field(default=16, validator=_positive)
    logprob_chunk_elements: int = attrs.field(default=2**27, validator=_positive)
    world_size: int = attrs.field(default=1, validator=_positive)
    max_shard_bytes: int = attrs.field(default=5 * 1024**3, validator=_positive)
    keep_grads_on_error: bool = attrs.field(default=True, validator=_bool)
    offload_while_sampling: bool = attrs.field(default=False, validator=_bool)
    peak_tflops: float | None = attrs.field(default=None, validator=_peak)
    train_vision_tower: bool = attrs.field(default=False, validator=_bool)
    max_image_pixels: int = attrs.field(default=4096 * 4096, validator=_positive)
    max_image_tokens_per_datum: int = attrs.field(default=16384, validator=_positive)
    max_image_tokens_per_call: int = attrs.field(default=65536, validator=_positive)
    max_image_pixels_per_call: int = attrs.field(default=4 * 4096 * 4096, validator=_positive)
    max_jpeg_scans: int = attrs.field(default=32, validator=_positive)
    max_image_decode_s: float = attrs.field(default=10.0, converter=to_float, validator=_positive_seconds)
    extra: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.dtype == "float16":
            raise InputError(
                "engine_config['dtype']: 'float16' is not supported: it needs a dynamic loss scaler, "
                "which the engines do not have; use 'bfloat16' (same speed, float32's range, no scaler)"
            )
        if self.dtype not in _COMPUTE_DTYPES:
            raise InputError(f"engine_config['dtype']: expected one of {list(_COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.master_dtype not in ("float32", "bfloat16"):
            raise InputError(
                f"engine_config['master_dtype']: expected 'float32' or 'bfloat16', got {self.master_dtype!r}"
            )
        if self.master_dtype == "bfloat16" and self.dtype != "bfloat16":
            raise InputError(
                "engine_config['master_dtype']: 'bfloat16' masters need dtype='bfloat16' "
                f"(got dtype={self.dtype!r}): the compute dtype cannot be wider than the stored weights"
            )
        if self.batching not in ("bucket", "pack"):
            raise InputError(f"engine_config['batching']: expected 'bucket' or 'pack', got {self.batching!r}")
        if self.prefix_sharing and self.attn_implementation not in (None, *PREFIX_SHARING_KERNELS):
            raise InputError(
                f"engine_config['prefix_sharing']: prefix sharing runs on the {list(PREFIX_SHARING_KERNELS)} attention "
                f"kernels, not attn_implementation={self.attn_implementation!r}; drop prefix_sharing (it is then off) "
                f"or choose one of those kernels")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype (what matmuls run in, what sampler weights are exported in)."""
        return _DTYPES[self.dtype]

    @property
    def master_torch_dtype(self) -> torch.dtype:
        """The dtype of the stored parameters, gradients and AdamW moments."""
        return _DTYPES[self.master_dtype]

    @property
    def mixed_precision(self) -> bool:
        """Compute in a narrower dtype than the masters (autocast / FSDP2 param_dtype)."""
        return self.torch_dtype != self.master_torch_dtype

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except RuntimeError as exc:
            raise InputError(f"engine_config['device']: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InputError("engine_config['device']: CUDA was requested but is not available")
        return dev

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None, extra_keys: tuple[str, ...] = ()) -> EngineConfig:
        """Build from a dict; keys in ``extra_keys`` (engine-specific) go to ``extra``."""
        cfg = dict(cfg or {})
        known = {f.name for f in attrs.fields(cls)} - {"extra"}
        extra = {k: cfg.pop(k) for k in list(cfg) if k in extra_keys}
        for key in cfg:
            if key not in known:
                accepted = sorted(known | set(extra_keys))
                raise InputError(f"engine_config: unknown key {key!r}; accepted keys: {accepted}"
                                 f"{did_you_mean(key, accepted)}")
        return cls(**cfg, extra=extra)
