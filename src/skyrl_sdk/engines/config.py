"""Typed engine_config shared by the built-in engines (unknown keys are an error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..errors import InputError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive(instance, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"engine_config[{attribute.name!r}]: expected a positive integer, got {value!r}")


@attrs.frozen
class EngineConfig:
    """Options every built-in engine understands.

    - ``device``: "auto" (CUDA when available, else CPU), "cpu", "cuda", "cuda:1", ...
    - ``dtype``: parameter dtype, "float32" (default) or "bfloat16" (CUDA).
    - ``micro_batch_tokens``: token budget of one micro-batch (padded tokens for buckets).
    - ``batching``: "bucket" (length-sorted, padded) or "pack" (one packed row).
    - ``logprob_chunk_elements``: tokens x vocab above which logprobs are chunked.
    - ``world_size``: ranks (FSDP engine only).
    - ``max_shard_bytes``: largest safetensors shard of an exported model.
    """

    device: str = "auto"
    dtype: str = "float32"
    micro_batch_tokens: int = attrs.field(default=8192, validator=_positive)
    batching: str = "bucket"
    logprob_chunk_elements: int = attrs.field(default=2**27, validator=_positive)
    world_size: int = attrs.field(default=1, validator=_positive)
    max_shard_bytes: int = attrs.field(default=5 * 1024**3, validator=_positive)
    extra: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise InputError(f"engine_config['dtype']: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.batching not in ("bucket", "pack"):
            raise InputError(f"engine_config['batching']: expected 'bucket' or 'pack', got {self.batching!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

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
                raise InputError(
                    f"engine_config: unknown key {key!r}; accepted keys: {sorted(known | set(extra_keys))}"
                )
        return cls(**cfg, extra=extra)
