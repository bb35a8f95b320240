"""Per-token KL-to-reference estimators and the entropy bonus, as SkyRL and verl define them.

With ``lp`` the learner's logprob and ``ref`` the reference model's (input ``ref_logprobs``),
``d = lp - ref`` (Schulman, "Approximating KL divergence", 2020):

- ``k1``  : ``d``                       (unbiased, can be negative)
- ``abs`` : ``|d|``
- ``k2``  : ``0.5 * d**2``
- ``k3`` = ``low_var_kl`` : ``exp(-d) + d - 1``, computed as SkyRL/verl do: ``-d`` clamped
  to [-20, 20] before ``exp``, the result clamped to [-10, 10]. Where a clamp is active the
  value is constant and its gradient zero.

The entropy bonus uses the model's next-token entropy ``H[t]`` (differentiable; its exact
gradient ``dH/dz = -p * (log p + H)`` flows to the logits).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "low_var_kl")
#: ``k3`` / ``low_var_kl``: clamp of ``ref - lp`` before exp, and of the estimate itself.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(learner || reference) from sampled-token logprobs."""
    if estimator == "k1":
        return lp - ref
    if estimator == "abs":
        return (lp - ref).abs()
    if estimator == "k2":
        return 0.5 * (lp - ref) ** 2
    if estimator in ("k3", "low_var_kl"):
        log_ratio = (ref - lp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    raise ValueError(f"unknown kl_estimator {estimator!r}; expected one of {list(KL_ESTIMATORS)}")
