"""What one training step tells the console, from what the server sees: the ``forward_backward``
calls since the previous ``optim_step``, merged.

Every step: the summed loss, tokens and weights (the loss per token), the calls' own throughput
(tokens per second of compute, MFU where the device's peak is known), and the policy's mean
entropy per scored token (the engine computes it). An **RL step** (a call whose datums carry
``advantages``) also has the curves that say whether RL is healthy, none of which needs the
rewards (the client keeps them):

- ``advantage_mean`` / ``advantage_std`` over the scored positions (``weights != 0`` where
  weights are sent, else ``advantages != 0``, as the losses score): a std near 0 means the
  groups carried no signal;
- ``sampled_tokens``: the scored positions (the completion tokens trained on);
- ``kl_sample_train``: the mean of sampler minus trainer logprob on them, the k1 estimate of
  KL(sampler || trainer): how far the sampler that drew the tokens is from the weights being
  trained (0 on policy; it grows with staleness or mismatched numerics);
- ``ratio_max`` and ``clip_fraction``: the largest importance ratio and the share of tokens
  where a clip was active (where the loss reports them).

The RL losses' group-normalized advantages sum to about zero, so their loss per token is
about zero whatever happens: the console does not make it an RL run's headline.

Sums are kept so that calls merge exactly: means are weighted by their token counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...losses.reduction import call_normalizers

#: the series this module adds to a step, in the console's order
RL_SERIES = ("advantage_mean", "advantage_std", "sampled_tokens", "kl_sample_train", "ratio_max", "clip_fraction")
STEP_SERIES = ("tokens_per_second", "mfu", "entropy", "rl")


def finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _scored_advantages(data: Sequence) -> np.ndarray | None:
    """The advantages at the scored positions of every datum, or None when no datum has any."""
    parts = []
    for d in data:
        adv = d.loss_fn_inputs.get("advantages")
        if adv is None or len(adv.shape) != 1:
            continue
        a = np.asarray(adv.array, dtype=np.float64)
        w = d.loss_fn_inputs.get("weights")
        mask = (np.asarray(w.array) != 0) if w is not None and w.shape == adv.shape else (a != 0)
        parts.append(a[mask])
    return np.concatenate(parts) if parts else None


def call_sums(metrics: Mapping[str, Any], data: Sequence) -> dict[str, float]:
    """One ``forward_backward``'s contribution to its step: sums only (so calls add up)."""
    out: dict[str, float] = {"weights": call_normalizers(data)[0]}
    for key in ("loss:sum", "num_tokens:sum", "seconds:sum"):
        if (v := finite(metrics.get(key))) is not None:
            out[key] = v
    # MFU weighted by each call's seconds: the step's model FLOPs over its compute time
    if (mfu := finite(metrics.get("mfu:mean"))) is not None and (s := finite(metrics.get("seconds:sum"))):
        out["mfu_seconds"], out["mfu_weight"] = mfu * s, s
    scored = finite(metrics.get("num_loss_tokens:sum"))
    if scored and (entropy := finite(metrics.get("entropy_loss:sum"))) is not None:
        out["entropy_sum"], out["entropy_tokens"] = entropy, scored
    adv = _scored_advantages(data)
    if adv is None:
        return out
    out.update(rl=1.0, adv_n=float(adv.size), adv_sum=float(adv.sum()), adv_sq=float((adv * adv).sum()))
    if scored:
        for key, name in (("kl_sample_train:mean", "kl"), ("clip_fraction:mean", "clip")):
            if (v := finite(metrics.get(key))) is not None:
                out[f"{name}_sum"], out[f"{name}_tokens"] = v * scored, scored
    if (v := finite(metrics.get("ratio_max:max"))) is not None:
        out["ratio_max"] = v
    return out


def merge_sums(acc: dict[str, float], call: Mapping[str, float]) -> dict[str, float]:
    """``acc`` with one more call's sums added (``ratio_max``: the larger)."""
    for key, value in call.items():
        if key == "ratio_max":
            acc[key] = max(acc.get(key, value), value)
        elif key == "rl":
            acc[key] = 1.0
        else:
            acc[key] = acc.get(key, 0.0) + value
    return acc


def step_values(acc: Mapping[str, float]) -> dict[str, float | None]:
    """A step's values from its calls' merged sums: the loss and token series, the entropy, and
    for an RL step the RL series (None where nothing was seen)."""
    loss, tokens, weights = acc.get("loss:sum"), acc.get("num_tokens:sum"), acc.get("weights")
    point: dict[str, float | None] = {
        "loss_sum": loss, "tokens": tokens, "loss_per_token": loss / weights if loss is not None and weights else None,
        # the forward_backward calls' own throughput (their compute time, not the client's waits)
        "tokens_per_second": tokens / acc["seconds:sum"] if tokens and acc.get("seconds:sum") else None,
        "mfu": acc["mfu_seconds"] / acc["mfu_weight"] if acc.get("mfu_weight") else None,
        "entropy": acc["entropy_sum"] / acc["entropy_tokens"] if acc.get("entropy_tokens") else None,
        "rl": acc.get("rl", 0.0) if "weights" in acc else None}
    n = acc.get("adv_n", 0.0)
    mean = acc["adv_sum"] / n if n else None
    var = max(0.0, acc["adv_sq"] / n - mean * mean) if mean is not None else None
    point.update(
        advantage_mean=mean, advantage_std=math.sqrt(var) if var is not None else None,
        sampled_tokens=n if acc.get("rl") else None,
        kl_sample_train=acc["kl_sum"] / acc["kl_tokens"] if acc.get("kl_tokens") else None,
        ratio_max=acc.get("ratio_max"),
        clip_fraction=acc["clip_sum"] / acc["clip_tokens"] if acc.get("clip_tokens") else None)
    return point
