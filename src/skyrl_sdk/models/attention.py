"""Which attention kernel a model runs (``engine_config["attn_implementation"]``), and where each runs.

transformers selects a kernel per model at load (``attn_implementation=``). We offer the ones
that train and score exactly the same model:

- ``sdpa`` (the default, for every family transformers has it for; the few without it, such as
  Gemma2, get ``eager``: transformers' own choice when none is named): torch's
  ``scaled_dot_product_attention``; flash / memory-efficient kernels on CUDA, a fused CPU kernel
  on CPU. Everything works with it (prefix sharing, packing).
- ``eager``: transformers' plain matmul-softmax-matmul; the reference (equal to ``sdpa`` within
  float32 rounding), slowest, the most memory (an L x L matrix per head).
- ``flash_attention_2`` / ``flash_attention_3``: the flash-attn package's kernels (CUDA only;
  FA3 on Hopper). Packed rows (``batching="pack"``: position ids restarting per datum, no mask)
  run as **varlen** attention: each datum attends only to itself, without a dense mask.
- ``flex_attention``: torch's FlexAttention (compiled); packed rows become a block-sparse mask.
  CUDA only here: torch has no FlexAttention backward on CPU (a trainer needs one).

With ``sdpa`` and ``eager`` a packed row is a dense block-diagonal causal mask (transformers
builds it from the position ids): exact, but its cost grows with the square of the row, which
is why ``bucket`` is the default layout there. Prefix sharing's two-part attention is written
over ``sdpa`` and ``eager`` only (:data:`PREFIX_SHARING_KERNELS`).

A kernel that cannot run here is refused by name before anything is loaded
(:func:`check_available`), instead of transformers' ImportError deep inside the load.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InputError

#: every kernel ``engine_config["attn_implementation"]`` accepts, the default first
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
#: None: transformers' default, ``sdpa`` where the family has it, else ``eager``
DEFAULT_ATTN_IMPLEMENTATION = None
#: the kernels prefix sharing's two-part attention runs over (``models.prefix_attention``)
PREFIX_SHARING_KERNELS = ("sdpa", "eager")
#: kernels that need a CUDA device, and why
CUDA_ONLY = {"flash_attention_2": "flash-attn has no {device} kernels",
             "flash_attention_3": "flash-attn has no {device} kernels",
             "flex_attention": "torch has no FlexAttention backward on {device}"}
#: how a packed row (``batching="pack"``) is attended, per kernel
PACKED_ROWS = {
    "sdpa": "a dense block-diagonal causal mask built from the position ids",
    "eager": "a dense block-diagonal causal mask built from the position ids",
    "flash_attention_2": "varlen attention (cumulative sequence lengths from the position ids): no mask",
    "flash_attention_3": "varlen attention (cumulative sequence lengths from the position ids): no mask",
    "flex_attention": "a block-sparse mask (FlexAttention's BlockMask) built from the position ids",
}
#: what to install for a kernel that needs a package
PACKAGES = {"flash_attention_2": "pip install flash-attn", "flash_attention_3": "flash-attn 3 (hopper/ build)",
            "flex_attention": "torch >= 2.5"}


def check_name(value: object) -> str | None:
    """``value`` if it names a kernel we offer (or is None: the default), else ``InputError``
    listing them."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in ATTN_IMPLEMENTATIONS:
        raise InputError(f"engine_config['attn_implementation']: expected one of {list(ATTN_IMPLEMENTATIONS)}, "
                         f"got {value!r}")
    return value


def installed(name: str) -> bool:
    """Whether the package behind kernel ``name`` imports here (transformers' own probes)."""
    from transformers import utils

    probes: dict[str, Callable[[], bool]] = {
        "flash_attention_2": utils.is_flash_attn_2_available,
        "flash_attention_3": getattr(utils, "is_flash_attn_3_available", lambda: False),
        "flex_attention": utils.is_torch_flex_attn_available,
    }
    probe = probes.get(name)
    return True if probe is None else bool(probe())


def unavailable_reason(name: str | None, device_type: str,
                       is_installed: Callable[[str], bool] = installed) -> str | None:
    """Why kernel ``name`` cannot run on a ``device_type`` device here, or None (it can).

    A pure function of its arguments (``is_installed`` is the package probe), so the CUDA
    decisions are tested on machines without a GPU."""
    if check_name(name) is None:
        return None
    if name in CUDA_ONLY and device_type != "cuda":
        why = CUDA_ONLY[name].format(device=device_type)
        return f"{name!r} runs on CUDA only ({why}); use 'sdpa' or 'eager'"
    if name in PACKAGES and not is_installed(name):
        return f"{name!r} needs {PACKAGES[name]}, which is not installed here"
    return None


def check_available(name: str | None, device_type: str, is_installed: Callable[[str], bool] = installed) -> None:
    """``InputError`` naming the option when kernel ``name`` cannot run on ``device_type``."""
    reason = unavailable_reason(name, device_type, is_installed)
    if reason is not None:
        raise InputError(f"engine_config['attn_implementation']: {reason}")
