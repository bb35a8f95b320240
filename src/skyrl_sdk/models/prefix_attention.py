"""Two-part attention over shared-prefix rows, as a transformers attention implementation.

For each group of a :class:`~.prefix.PrefixPlan` (the "Prefix Grouper" split):

1. the prefix attends to itself, causally (SDPA with ``is_causal``: no mask, flash on CUDA);
2. the G suffixes, right-padded into a (G, Smax) batch, attend to the prefix's keys and
   values (expanded over the G rows) followed by their own, lower-right causal:
   suffix token i sits at position P + i and sees keys 0 .. P + i (torch's
   ``causal_lower_right`` bias: no mask tensor, SDPA's fused kernels on CUDA). The padding
   lies to the right of every real query, so it needs no mask of its own.

Memory: concatenating the expanded prefix with the suffixes' own keys and values copies it,
G x (P + Smax) slots per layer, and autograd keeps that copy for backward. A 1000-token
prompt with 256 four-token samples made that 256 prefixes' keys and values per layer, twice
the peak of the unshared path (whose micro-batch budget bounds what it holds). So a plan
says how many suffix rows each call takes (:func:`~.prefix.expansion_rows`: what one row
keeps is bounded by its budget); a group beyond it runs in calls of that many rows under
non-reentrant activation checkpointing, which keeps only their inputs and recomputes the
expansion in backward (measured in docs/performance.md, "Prefix sharing's memory").

Per-layer sliding windows (the ``sliding_window`` keyword every family passes, ``None`` on
full-attention layers) are applied on positions; attention soft-capping (Gemma2's
``softcap``) and an ``eager`` base run the same mathematics as transformers' eager attention.

Why not a mask over the packed row (a 4D ``attention_mask`` tree mask): it is N x N dense,
CPU SDPA computes the whole square, and on CUDA any explicit mask moves SDPA off its flash
kernel; measured, it lost to this split on long rows (docs/engines.md).

The implementations are registered as ``skyrl_prefix_sdpa`` and ``skyrl_prefix_eager``. A call
without a plan (sampling, the bucket and pack layouts) runs the base implementation
unchanged, with the base's masks, so a model is switched once, at load, and never toggled
(activation checkpointing recomputes blocks in backward, after the forward has returned).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .loading import hf_model
from .prefix import GroupSlots, PrefixPlan
from .vlm import is_vision_language

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: The backbone keyword that carries the :class:`PrefixPlan` down to every attention layer.
PLAN_KWARG = "skyrl_prefix_plan"
#: The families whose attention was checked to take shared rows exactly (tests/test_prefix_*.py).
SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2"})
#: base implementation -> ours
IMPLEMENTATIONS = {"sdpa": "skyrl_prefix_sdpa", "eager": "skyrl_prefix_eager"}
BASES = {ours: base for base, ours in IMPLEMENTATIONS.items()}


def _model_eager(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The eager attention of the module's own modeling file (Gemma2's applies soft-capping)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward in its modeling module")
    return fn


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float,
            softcap: float | None, math: bool, dropout: float, gqa: bool = False) -> torch.Tensor:
    """(B, H, Q, d) attention; ``mask`` bool (True = may attend), or None for plain causal
    (SDPA only). ``gqa``: ``k`` and ``v`` have fewer heads, each shared by H / Hkv queries."""
    if not math:
        device = q.device.type
        if torch.is_autocast_enabled(device):
            # a causal bias dispatches before autocast casts: cast as autocast would
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                              scale=scaling, enable_gqa=gqa)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
    w = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)  # type: ignore[operator]  # math: callers always pass a mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(w, p=dropout), v)


def _suffixes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: GroupSlots, rows: slice, a: int, p: int, *,
              scaling: float, softcap: float | None, window: int | None, math: bool, dropout: float,
              plan: PrefixPlan) -> torch.Tensor:
    """Attention of suffix rows ``rows`` of group ``g``: (R, H, Smax, d). ``k`` and ``v`` have
    the model's key-value heads; the prefix's are expanded over the R rows and to the query
    heads here, so that only this call's copy exists (see the module docstring)."""
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[2]
    width = g.width
    index = g.gather[rows.start * width:rows.stop * width]  # type: ignore[index]  # None only when count 0 (skipped)
    count = rows.stop - rows.start

    def padded(t: torch.Tensor) -> torch.Tensor:  # (h, N, d) -> (R, h, Smax, d), right-padded
        return t.index_select(1, index).view(t.shape[0], count, width, dim).transpose(0, 1)

    def keys(t: torch.Tensor) -> torch.Tensor:  # the prefix's and the row's own, per query head
        out = torch.cat([t[:, a:a + p].unsqueeze(0).expand(count, kv_heads, p, dim), padded(t)], dim=2)
        return out if kv_heads == heads else out.repeat_interleave(heads // kv_heads, dim=1)

    if window is None and not math:  # no mask tensor: SDPA's own lower-right causal kernels
        smask: torch.Tensor = causal_lower_right(width, p + width)
    else:
        smask = plan.mask(width, p, p + width, window, q.device)
    return _attend(padded(q), keys(k), keys(v), smask, scaling, softcap, math, dropout)


def _two_part(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: PrefixPlan,
              *, scaling: float | None, softcap: float | None, window: int | None, math: bool, dropout: float
              ) -> tuple[torch.Tensor, None]:
    # imported here: torch.utils.checkpoint loads torch._dynamo
    from torch.utils.checkpoint import checkpoint

    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    # (H, N, d) and (Hkv, N, d): a shared row is one batch row; keys and values keep the model's
    # own heads (what the unshared path keeps too), repeated per query head only where expanded
    q, k, v = query[0], key[0], value[0]
    heads, _, dim = q.shape
    gqa = k.shape[0] != heads
    device = q.device
    keeps_graph = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    options: dict[str, Any] = dict(scaling=scaling, softcap=softcap, window=window, math=math, dropout=dropout,
                                   plan=plan)
    outs = []
    for g in plan.groups:
        a, p = g.start, g.prefix
        qp, kp, vp = q[:, a:a + p], k[:, a:a + p], v[:, a:a + p]
        pmask = plan.mask(p, 0, p, window, device) if window is not None or math else None
        outs.append(_attend(qp[None], kp[None], vp[None], pmask, scaling, softcap, math, dropout, gqa)[0])
        if g.count == 0:
            continue
        step = g.rows if 0 < g.rows < g.count else g.count
        parts = []
        for r in range(0, g.count, step):
            rows = slice(r, min(g.count, r + step))
            if not g.kept and keeps_graph:  # recomputed in backward: no G x P expansion is kept
                parts.append(checkpoint(_suffixes, q, k, v, g, rows, a, p, use_reentrant=False, **options))
            else:
                parts.append(_suffixes(q, k, v, g, rows, a, p, **options))
        o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # (G, H, Smax, d)
        assert g.unpad is not None  # None only in a group without suffixes (count 0, skipped above)
        outs.append(o.transpose(0, 1).reshape(heads, g.count * g.width, dim).index_select(1, g.unpad))
    out = torch.cat(outs, dim=1)  # (H, N, d), in row order
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def _implementation(base: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = kwargs.get(PLAN_KWARG)
        if plan is None:  # an ordinary call: the base implementation, as if we were not here
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            fn = sdpa_attention_forward if base == "sdpa" else _model_eager(module)
            return fn(module, query, key, value, attention_mask, **kwargs)
        if query.shape[0] != 1 or query.shape[2] != plan.length:
            raise RuntimeError(f"a shared-prefix plan of {plan.length} slots met queries of shape {tuple(query.shape)}")
        softcap = kwargs.get("softcap")
        return _two_part(module, query, key, value, plan, scaling=kwargs.get("scaling"), softcap=softcap,
                         window=kwargs.get("sliding_window"), math=base == "eager" or softcap is not None,
                         dropout=kwargs.get("dropout", 0.0) if module.training else 0.0)

    attention.__name__ = f"{IMPLEMENTATIONS[base]}_attention"
    return attention


@functools.cache
def _register() -> None:
    """Register our implementations with transformers (once; importing transformers' attention
    registries is not free, so it waits for the first model switched)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for base, ours in IMPLEMENTATIONS.items():
        AttentionInterface.register(ours, _implementation(base))
        AttentionMaskInterface.register(ours, sdpa_mask if base == "sdpa" else eager_mask)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s attention cannot take shared rows (None: it can)."""
    config = hf_model(model).config
    model_type = getattr(config, "model_type", None)
    impl = config._attn_implementation
    if is_vision_language(config):
        return ("a vision-language model computes every datum in full (images and their M-RoPE positions are "
                "not shared)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {model_type!r} is not one prefix sharing was checked on "
                f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    if impl not in IMPLEMENTATIONS and impl not in BASES:
        return f"attention implementation {impl!r} (shared rows need 'sdpa' or 'eager')"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size)"
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def enable(model: torch.nn.Module) -> str | None:
    """Switch ``model`` (a causal LM, a critic or a peft wrapper) to the prefix-aware
    implementation of its attention, for good; returns why it cannot, or None."""
    reason = unsupported_reason(model)
    if reason is None:
        _register()
        config = hf_model(model).config
        config._attn_implementation = IMPLEMENTATIONS.get(config._attn_implementation, config._attn_implementation)
    return reason


def disable(model: torch.nn.Module) -> None:
    """Back to the base implementation (only before any forward that checkpointing may replay)."""
    config = hf_model(model).config
    config._attn_implementation = BASES.get(config._attn_implementation, config._attn_implementation)


def enabled(model: torch.nn.Module) -> bool:
    return hf_model(model).config._attn_implementation in BASES


def shared_hidden(backbone: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                  plan: PrefixPlan) -> torch.Tensor:
    """The (N, H) last hidden states of a shared-prefix row (refused on a model whose attention
    would ignore the plan: never silently wrong)."""
    if backbone.config._attn_implementation not in BASES:
        raise RuntimeError("a shared-prefix row on a model whose attention is not prefix-aware")
    out = backbone(input_ids=input_ids, attention_mask=sentinel_mask(input_ids.device), position_ids=position_ids,
                   use_cache=False, **{PLAN_KWARG: plan})
    return out.last_hidden_state[0]


def sentinel_mask(device: torch.device) -> torch.Tensor:
    """The ``attention_mask`` of a shared call: a 4D tensor, which transformers' mask builders
    pass through untouched (no N x N mask is built, and positions that restart are not read
    as packed sequences); the attention above never reads it."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
