"""Target log-probabilities (and entropy) from hidden states, fast and memory-lean.

Scoring T tokens against a V-word vocabulary materialises (T x V) float32 logits. For a
plain linear output layer (the usual case) a fused autograd function does it:

- forward computes ``logits -> logsumexp -> log-probs`` in place, gathers the targets and
  (if asked) the entropy from the same buffer, and keeps only the probabilities for backward;
- backward turns the kept probabilities into the logits gradient in place
  (``g * (onehot - p)``) and runs the two lm_head matmuls: no zero-filled (T x V) buffer, no
  separate log-softmax backward;
- above ``chunk_elements`` (tokens x vocab) nothing of size (T x V) is kept: forward runs
  chunk by chunk (chunks of at most :data:`CHUNK_SIZE_ELEMENTS` elements) and backward
  recomputes each chunk's logits (one more lm_head matmul: a little compute for a lot of
  memory).

Heads with logit scaling or soft-capping, LoRA-wrapped or hooked heads take the generic
path (autograd through the head, chunks under activation checkpointing).

Mixed precision: the head's matmul runs in the compute dtype (autocast's, or the bf16
parameters FSDP2 gathers), as every other matmul; everything after it (log-softmax,
logsumexp, gather, entropy and their gradients) is float32, and so are the returned
log-probabilities.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Logit elements (tokens x vocab) above which scoring is chunked. 2**27 fp32 = 512 MiB.
CHUNK_THRESHOLD_ELEMENTS = 2**27
#: Largest chunk (tokens x vocab) once chunking: 2**24 fp32 = 64 MiB per live buffer.
CHUNK_SIZE_ELEMENTS = 2**24


def _score(logits: torch.Tensor, targets: torch.Tensor, want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if targets.dim() == 1:
        lp = -F.cross_entropy(logits, targets, reduction="none")
    else:  # top-K targets (T, K)
        lp = (logits - torch.logsumexp(logits, dim=-1, keepdim=True)).gather(1, targets)
    if want_entropy:
        entropy = _Entropy.apply(logits) if torch.is_grad_enabled() and logits.requires_grad else _entropy(logits)
    else:
        entropy = logits.new_zeros(0)
    return lp, entropy


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        return -torch.special.xlogy(probs, probs).sum(-1)


def _entropy_grad_(probs: torch.Tensor, entropy: torch.Tensor, grad_entropy: torch.Tensor) -> torch.Tensor:
    """d(sum g * H)/d logits = -g * p * (log p + H), written into a new (T x V) buffer."""
    out = torch.special.xlogy(probs, probs)
    out.addcmul_(probs, entropy.unsqueeze(-1))
    return out.mul_(grad_entropy.neg().unsqueeze(-1))


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(logits) with its exact gradient; keeps only the logits for backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        entropy = _entropy(logits)
        ctx.save_for_backward(logits, entropy)
        return entropy

    @staticmethod
    def backward(ctx: Any, grad_entropy: torch.Tensor) -> torch.Tensor:
        logits, entropy = ctx.saved_tensors
        return _entropy_grad_(torch.softmax(logits.float(), dim=-1), entropy, grad_entropy.float()).to(logits.dtype)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on (mixed precision), else
    the operands'. The log-softmax, logsumexp, gather and entropy are float32 either way."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


@overload
def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor: ...
@overload
def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None: ...
def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


#: A head projection may define a method of this name, ``(hidden, targets, chunk,
#: want_entropy) -> (lp, entropy)``, to run the fused path itself: an engine that wraps the
#: projection (an FSDP2 unit, which gathers its weight only inside its own calls) installs
#: one that calls :func:`linear_target_logprobs` within the wrapper's hooks.
FUSED_METHOD = "fused_target_logprobs"


def fusable_linear(head: object) -> torch.nn.Linear | None:
    """The head's projection when the fused path applies to it: a plain ``nn.Linear`` (no
    wrapper, no hook) with no logit scale or soft-cap; ``None`` otherwise (the generic path)."""
    proj = getattr(head, "proj", None)
    if type(proj) is not torch.nn.Linear or getattr(head, "scale", None) is not None or getattr(head, "softcap", None):
        return None
    if proj._forward_hooks or proj._forward_pre_hooks or torch.nn.modules.module._global_forward_hooks:
        return None
    return proj


def _fused_entry(head: object) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """How to run the fused path for ``head``: the projection's own ``FUSED_METHOD`` (an
    engine's wrapper installed it on a head that was fusable), else the plain linear's."""
    entry = getattr(getattr(head, "proj", None), FUSED_METHOD, None)
    if entry is not None:
        return entry
    proj = fusable_linear(head)
    return None if proj is None else functools.partial(linear_target_logprobs, proj.weight, proj.bias)


def _logprobs_inplace(
    logits: torch.Tensor, targets: torch.Tensor, want_entropy: bool, keep_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """From a float32 logits buffer we own: (lp, entropy, logsumexp, probs or None).

    ``logits`` is overwritten (it becomes the log-probabilities, then is dropped).
    """
    # logsumexp by hand, in place: one (T x V) allocation (the probabilities) in all
    lse = logits.amax(dim=-1)
    lse.masked_fill_(~torch.isfinite(lse), 0.0)  # rows of -inf stay -inf, not nan
    shifted = logits.sub_(lse.unsqueeze(-1))
    probs = torch.exp(shifted)
    total = probs.sum(dim=-1)
    log_total = total.log()
    logp = shifted.sub_(log_total.unsqueeze(-1))
    lse.add_(log_total)
    idx = targets.unsqueeze(-1) if targets.dim() == 1 else targets
    lp = logp.gather(1, idx)
    lp = lp.squeeze(-1) if targets.dim() == 1 else lp
    entropy = None
    if keep_probs or want_entropy:
        probs.div_(total.unsqueeze(-1))
        if want_entropy:  # -sum p log p, in place in the log-prob buffer (dropped next)
            entropy = logp.mul_(probs).sum(-1).neg_()
    return lp, entropy, lse, (probs if keep_probs else None)


def _grad_logits_(probs: torch.Tensor, targets: torch.Tensor, grad_lp: torch.Tensor) -> torch.Tensor:
    """In place: ``probs`` becomes d(sum grad_lp * lp)/d logits = grad_lp * (onehot - p)."""
    if targets.dim() == 1:
        probs.mul_(grad_lp.neg().unsqueeze(-1))
        probs.scatter_add_(1, targets.unsqueeze(-1), grad_lp.unsqueeze(-1).to(probs.dtype))
    else:  # top-K: sum over k of g_k * (onehot_k - p)
        probs.mul_(grad_lp.sum(-1, keepdim=True).neg())
        probs.scatter_add_(1, targets, grad_lp.to(probs.dtype))
    return probs


class _LinearLogprobs(torch.autograd.Function):
    """``lp = log_softmax(hidden @ weight.T + bias)[targets]`` with the entropy as a side output.

    Backward consumes the kept probabilities in place: the graph supports one backward
    (the engines never pass ``retain_graph``).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int, want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        keep = num_tokens <= chunk  # one chunk: keep the probabilities, no recompute
        ctx.compute_dtype = compute = matmul_dtype(hidden, weight)
        w, b = _cast(weight, compute), _cast(bias, compute)
        lps: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        probs = None
        for start in range(0, num_tokens, chunk):
            h, t = hidden[start : start + chunk], targets[start : start + chunk]
            logits = F.linear(_cast(h, compute), w, b).float()
            lp, ent, lse, probs = _logprobs_inplace(logits, t, want_entropy, keep)
            del logits
            lps.append(lp)
            lses.append(lse)
            if ent is not None:  # want_entropy
                ents.append(ent)
        lp = lps[0] if len(lps) == 1 else torch.cat(lps)
        ctx.chunk = chunk
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias, targets, probs if keep else torch.cat(lses))
        ctx.keep = keep
        ctx.set_materialize_grads(False)  # an unused entropy sends no gradient: no extra work
        if want_entropy:
            entropy = ents[0] if len(ents) == 1 else torch.cat(ents)
            ctx.entropy = entropy.detach()
            return lp, entropy
        empty = lp.new_zeros(0)
        ctx.mark_non_differentiable(empty)
        return lp, empty

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_entropy: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, bias, targets, saved = ctx.saved_tensors
        if grad_lp is None:
            grad_lp = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = grad_b = None
        chunk = ctx.chunk
        compute = ctx.compute_dtype  # the forward's matmul dtype (autocast is off in backward)
        w, b = _cast(weight, compute), _cast(bias, compute)
        for start in range(0, hidden.shape[0], chunk):
            h, t, g = hidden[start : start + chunk], targets[start : start + chunk], grad_lp[start : start + chunk]
            h = _cast(h, compute)
            if ctx.keep:
                probs = saved
            else:  # recompute this chunk's probabilities from the saved logsumexp
                probs = F.linear(h, w, b).float()
                probs.sub_(saved[start : start + chunk].unsqueeze(-1)).exp_()
            if grad_entropy is not None:  # the entropy bonus: add its exact gradient
                ent_part = _entropy_grad_(
                    probs, ctx.entropy[start : start + chunk], grad_entropy[start : start + chunk].float()
                )
            dlogits = _grad_logits_(probs, t, g.float())
            if grad_entropy is not None:
                dlogits.add_(ent_part)
                del ent_part
            del probs
            dlogits = _cast(dlogits, compute)
            if grad_h is not None:  # need_h
                if grad_h.dtype == compute:
                    torch.mm(dlogits, w, out=grad_h[start : start + chunk])
                else:
                    grad_h[start : start + chunk] = dlogits @ w
            # weight / bias gradients: summed over chunks in float32 (a bf16 sum would round)
            if need_w:
                part = dlogits.t() @ h
                grad_w = part.float() if grad_w is None else grad_w.add_(part)
            if need_b:
                part = dlogits.sum(0)
                grad_b = part.float() if grad_b is None else grad_b.add_(part)
            del dlogits
        grad_w = _cast(grad_w, weight.dtype)
        grad_b = _cast(grad_b, None if bias is None else bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def linear_target_logprobs(
    weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, targets: torch.Tensor,
    chunk: int, want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused path for a plain linear head, ``chunk`` tokens at a time: with gradients
    through :class:`_LinearLogprobs`, without them chunk by chunk under no_grad. The entropy
    is an empty tensor when not wanted."""
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if grad:
        return _LinearLogprobs.apply(hidden, weight, bias, targets, chunk, want_entropy)
    with torch.no_grad():
        compute = matmul_dtype(hidden, weight)
        w, b = _cast(weight, compute), _cast(bias, compute)
        lps: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(_cast(hidden[start : start + chunk], compute), w, b).float()
            lp, ent, _, _ = _logprobs_inplace(logits, targets[start : start + chunk], want_entropy, False)
            lps.append(lp)
            if ent is not None:  # want_entropy
                ents.append(ent)
        return torch.cat(lps), (torch.cat(ents) if want_entropy else lps[0].new_zeros(0))


def target_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    vocab_size: int,
    *,
    want_entropy: bool = True,
    chunk_elements: int = CHUNK_THRESHOLD_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lp[t] = log softmax(head(hidden[t]))[targets[t]]`` for (T, H) hidden states.

    Returns ``(lp, entropy)``; ``entropy`` (or ``None``) carries its exact gradient when
    computed with gradients (it costs nothing in backward unless a loss uses it).
    """
    num_tokens = hidden.shape[0]
    vocab = max(1, vocab_size)
    chunked = num_tokens * vocab > chunk_elements
    chunk = max(1, min(chunk_elements, CHUNK_SIZE_ELEMENTS) // vocab) if chunked else max(1, num_tokens)
    fused = _fused_entry(head) if num_tokens > 0 else None
    if fused is not None:
        lp, ent = fused(hidden, targets, chunk, want_entropy)
        return lp, (ent if want_entropy else None)
    if not chunked:
        lp, ent = _score(head(hidden), targets, want_entropy)
        return lp, (ent if want_entropy else None)

    def run(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _score(head(h), t, want_entropy)

    lps, ents = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, num_tokens, chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        lp, ent = checkpoint(run, h, t, use_reentrant=False) if grad else run(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if want_entropy else None)
