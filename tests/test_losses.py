"""Built-in losses against independent references (plain torch, closed-form gradients).

Every reference here is written from the math in docs/losses.md, not from the module's code:
loss values are recomputed directly and gradients w.r.t. the target logprobs are the
closed-form derivatives, compared with ``torch.autograd.grad`` of the module's loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from skyrl_sdk import get_registry
from skyrl_sdk.evaluate import evaluate_loss
from skyrl_sdk.losses import LossInput
from skyrl_sdk.losses.dialects import convert_tinker_loss_config
from skyrl_sdk.losses.metrics import MetricAccumulator
from skyrl_sdk.losses.run import run_loss

POLICY_LOSSES = (
    "importance_sampling", "regular", "dual_clip", "gspo", "cispo", "sapo", "dro", "clip_cov", "kl_cov",
)
ALL_BUILTIN = POLICY_LOSSES + ("cross_entropy", "value")
SEEDS = (0, 1, 2, 3)
N = 48
N_PROMPT = 8
ATOL = 1e-5


# ---- data and helpers ----------------------------------------------------------------------


def make_data(seed: int, *, weights: bool, n: int = N, spread: float = 0.5, offset: float = 0.0):
    """Tinker-shaped data: a prompt (A = 0, q = 0) then response tokens with mixed-sign A."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 2.0 - 0.05
    q = lp + torch.randn(n, generator=g) * spread + offset
    adv = torch.randn(n, generator=g)
    q[:N_PROMPT] = 0.0
    adv[:N_PROMPT] = 0.0
    inputs = {"logprobs": q, "advantages": adv}
    if weights:
        w = torch.rand(n, generator=g) * 2.0
        w[torch.rand(n, generator=g) < 0.25] = 0.0
        w[:N_PROMPT] = 0.0
        inputs["weights"] = w
    return lp, inputs


def mask_of(inputs):
    w = inputs.get("weights")
    ref = inputs["advantages"] if "advantages" in inputs else inputs["returns"]
    return w if w is not None else torch.ones_like(ref)


def scored_of(inputs):
    w = inputs.get("weights")
    return (w != 0) if w is not None else (inputs["advantages"] != 0)


def ratio_of(lp, q):
    return torch.exp(torch.clamp(lp - q, min=-20.0, max=20.0))


def loss_and_grad(name, lp, inputs, config=None, dialect="native", **kw):
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = evaluate_loss(name, leaf, inputs, config, dialect=dialect, **kw)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=1e-5)


def ref_ppo(lp, q, adv, m, lo, hi):
    """PPO clip written as A*min(r, hi) for A >= 0 and A*max(r, lo) for A < 0."""
    r = ratio_of(lp, q)
    lo = torch.as_tensor(lo, dtype=r.dtype).expand_as(r)
    hi = torch.as_tensor(hi, dtype=r.dtype).expand_as(r)
    objective = torch.where(adv >= 0, adv * torch.minimum(r, hi), adv * torch.maximum(r, lo))
    per_token = -objective
    clipped = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    grad = torch.where(clipped, torch.zeros_like(r), -adv * r * m)
    return per_token, grad, clipped


# ---- registry shape ------------------------------------------------------------------------


def test_builtin_specs():
    reg = get_registry()
    for name in POLICY_LOSSES:
        spec = reg.losses[name]
        assert spec.role == "policy"
        assert spec.required_inputs == ("target_tokens", "logprobs", "advantages")
        assert "weights" in spec.optional_inputs
        assert spec.outputs == ("logprobs", "elementwise_loss")
    for name in ("regular", "dual_clip", "gspo", "cispo"):
        assert {"clip_low_threshold", "clip_high_threshold"} <= set(reg.losses[name].optional_inputs)
    assert "sequence_ratio_mask" in reg.losses["gspo"].optional_inputs
    assert "clip_cov_selected" in reg.losses["clip_cov"].optional_inputs
    assert "kl_cov_selected" in reg.losses["kl_cov"].optional_inputs
    assert reg.losses["clip_cov"].prepare is not None and reg.losses["kl_cov"].prepare is not None
    value = reg.losses["value"]
    assert value.role == "critic" and value.outputs == ("values", "elementwise_loss")
    assert value.required_inputs == ("values", "returns")
    defaults = {n: reg.losses[n].config_defaults() for n in ALL_BUILTIN}
    assert defaults["regular"] == {"eps_clip_low": 0.2, "eps_clip_high": 0.2}
    assert defaults["dual_clip"]["clip_ratio_c"] == 3.0
    assert defaults["cispo"] == {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0}
    assert defaults["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert defaults["dro"] == {"beta": 0.1}
    assert defaults["value"] == {"value_clip": 0.2}
    assert defaults["importance_sampling"] == {} and defaults["cross_entropy"] == {}


# ---- each loss against its reference ------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
def test_importance_sampling(seed, weights):
    lp, inp = make_data(seed, weights=weights)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    loss, grad, metrics = loss_and_grad("importance_sampling", lp, inp)
    r = ratio_of(lp, q)
    assert_close(loss, -(r * adv * m).sum())
    assert_close(grad, -r * adv * m)
    s = scored_of(inp)
    assert metrics["num_loss_tokens:sum"] == s.sum().item()
    assert metrics["pg_loss:sum"] == pytest.approx(loss.item(), abs=1e-5)
    assert metrics["kl_sample_train:mean"] == pytest.approx(((q - lp)[s]).mean().item(), abs=1e-5)
    assert metrics["ratio_max:max"] == pytest.approx(r[s].max().item(), rel=1e-5)
    assert metrics["ratio_min:min"] == pytest.approx(r[s].min().item(), rel=1e-5)
    assert metrics["ratio_mean:mean"] == pytest.approx(r[s].mean().item(), rel=1e-5)
    assert metrics["clip_fraction:mean"] == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.28)])
def test_regular(seed, weights, eps):
    lp, inp = make_data(seed, weights=weights)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    loss, grad, metrics = loss_and_grad("regular", lp, inp, {"eps_clip_low": eps[0], "eps_clip_high": eps[1]})
    per_token, ref_grad, clipped = ref_ppo(lp, q, adv, m, 1 - eps[0], 1 + eps[1])
    s = scored_of(inp)
    assert clipped[s].any() and (~clipped[s]).any(), "data should have clipped and unclipped tokens"
    assert (adv[s] > 0).any() and (adv[s] < 0).any()
    assert_close(loss, (per_token * m).sum())
    assert_close(grad, ref_grad)
    assert metrics["clip_fraction:mean"] == pytest.approx(clipped[s].float().mean().item())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip(seed, weights, c):
    lp, inp = make_data(seed, weights=weights, spread=0.8)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    loss, grad, metrics = loss_and_grad("dual_clip", lp, inp, {"clip_ratio_c": c})
    per_token, ref_grad, clipped = ref_ppo(lp, q, adv, m, 0.8, 1.2)
    cap = -c * adv
    dual = (adv < 0) & (cap < per_token)
    per_token = torch.where(dual, cap, per_token)
    ref_grad = torch.where(dual, torch.zeros_like(ref_grad), ref_grad)
    if c == 1.5:
        assert dual[scored_of(inp)].any(), "data should exercise the dual clip"
    assert_close(loss, (per_token * m).sum())
    assert_close(grad, ref_grad)
    s = scored_of(inp)
    assert metrics["dual_clip_fraction:mean"] == pytest.approx(dual[s].float().mean().item())
    assert metrics["clip_fraction:mean"] == pytest.approx((dual | clipped)[s].float().mean().item())


def ref_gspo(lp, inp, lo, hi, positions):
    """One datum: s = exp(mean_M(lp - q)) for every token; grad of token t is -A_t * s (if unclipped)."""
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    log_s = (lp - q)[positions].mean() if positions.any() else torch.tensor(0.0)
    s = torch.exp(torch.clamp(log_s, -20, 20)).expand_as(lp)
    lo_t = torch.as_tensor(lo).float().expand_as(lp)
    hi_t = torch.as_tensor(hi).float().expand_as(lp)
    objective = torch.where(adv >= 0, adv * torch.minimum(s, hi_t), adv * torch.maximum(s, lo_t))
    clipped = ((adv > 0) & (s > hi_t)) | ((adv < 0) & (s < lo_t))
    grad = torch.where(clipped, torch.zeros_like(lp), -adv * s * m)
    return -(objective * m).sum(), grad, clipped


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("offset", [-0.4, 0.0, 0.4])
def test_gspo(seed, weights, offset):
    lp, inp = make_data(seed, weights=weights, offset=offset)
    positions = inp["advantages"] != 0
    if weights:
        positions &= inp["weights"] != 0
    loss, grad, metrics = loss_and_grad("gspo", lp, inp)
    ref_loss, ref_grad, clipped = ref_gspo(lp, inp, 0.8, 1.2, positions)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    s = scored_of(inp)
    assert metrics["clip_fraction:mean"] == pytest.approx(clipped[s].float().mean().item())


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_gspo_sequence_ratio_mask(seed):
    lp, inp = make_data(seed, weights=False, offset=0.3)
    srm = torch.zeros(N)
    srm[N_PROMPT + 5: N_PROMPT + 20] = 1.0
    inp["sequence_ratio_mask"] = srm
    loss, grad, _ = loss_and_grad("gspo", lp, inp, {"eps_clip_low": 0.1, "eps_clip_high": 0.1})
    ref_loss, ref_grad, _ = ref_gspo(lp, inp, 0.9, 1.1, srm != 0)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


def test_gspo_gradient_flows_only_through_own_logprob():
    """A nonzero advantage at one token only: the gradient is nonzero at that token only,
    although the sequence ratio averages over many positions."""
    lp, inp = make_data(0, weights=False)
    adv = torch.zeros(N)
    adv[20] = 1.5
    inp["advantages"] = adv
    srm = torch.zeros(N)
    srm[N_PROMPT:] = 1.0
    inp["sequence_ratio_mask"] = srm
    _, grad, _ = loss_and_grad("gspo", lp, inp, {"eps_clip_low": 1.0, "eps_clip_high": 100.0})
    s = torch.exp((lp - inp["logprobs"])[N_PROMPT:].mean())
    expected = torch.zeros(N)
    expected[20] = -1.5 * s
    assert_close(grad, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("cfg,bounds", [(None, (0.0, 5.0)), ({"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.2}, (0.8, 1.2))])
def test_cispo(seed, weights, cfg, bounds):
    lp, inp = make_data(seed, weights=weights, spread=0.8)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    loss, grad, metrics = loss_and_grad("cispo", lp, inp, cfg)
    weight = torch.clamp(ratio_of(lp, q), bounds[0], bounds[1])
    assert_close(loss, -(adv * weight * lp * m).sum())
    # stop-gradient through the IS weight: d/dlp = -A * clamp(ratio) * mask, never zeroed
    assert_close(grad, -adv * weight * m)
    r = ratio_of(lp, q)
    s = scored_of(inp)
    clipped = (r < bounds[0]) | (r > bounds[1])
    assert metrics["clip_fraction:mean"] == pytest.approx(clipped[s].float().mean().item())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo(seed, weights, taus):
    lp, inp = make_data(seed, weights=weights)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    loss, grad, _ = loss_and_grad("sapo", lp, inp, {"tau_pos": taus[0], "tau_neg": taus[1]})
    r = ratio_of(lp, q)
    tau = torch.where(adv > 0, torch.tensor(taus[0]), torch.tensor(taus[1]))
    sig = 1.0 / (1.0 + torch.exp(-tau * (r - 1.0)))
    assert_close(loss, -(sig * (4.0 / tau) * adv * m).sum())
    assert_close(grad, -4.0 * adv * sig * (1.0 - sig) * r * m)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("beta", [None, 0.5])
def test_dro(seed, weights, beta):
    lp, inp = make_data(seed, weights=weights)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    b = 0.1 if beta is None else beta
    loss, grad, metrics = loss_and_grad("dro", lp, inp, None if beta is None else {"beta": beta})
    assert_close(loss, -((lp * adv - 0.5 * b * (lp - q) ** 2) * m).sum())
    assert_close(grad, -(adv - b * (lp - q)) * m)
    expected_scored = (m != 0).sum().item() if weights else N
    assert metrics["num_loss_tokens:sum"] == expected_scored


def ref_cov(lp, inp):
    s = scored_of(inp)
    adv = inp["advantages"]
    return (lp - lp[s].mean()) * (adv - adv[s].mean()), s


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
def test_clip_cov_all_candidates(seed, weights):
    """clip_ratio = 1 selects every candidate: PPO loss value, zero gradient on candidates."""
    lp, inp = make_data(seed, weights=weights)
    inp["advantages"] = inp["advantages"] * 3.0
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    cfg = {"clip_ratio": 1.0, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}
    loss, grad, metrics = loss_and_grad("clip_cov", lp, inp, cfg)
    per_token, ppo_grad, clipped = ref_ppo(lp, q, adv, m, 0.8, 1.2)
    cov, s = ref_cov(lp, inp)
    cand = s & ~clipped & (cov > 0.0) & (cov < 5.0)
    assert cand.any() and (s & ~cand & ~clipped).any()
    assert_close(loss, (per_token * m).sum())
    assert_close(grad, torch.where(cand, torch.zeros_like(grad), ppo_grad))
    assert metrics["clip_cov_fraction:mean"] == pytest.approx(cand[s].float().mean().item())


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_random_subset(seed):
    lp, inp = make_data(seed, weights=False)
    inp["advantages"] = inp["advantages"] * 3.0
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    cfg = {"clip_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0, "seed": seed}
    loss, grad, _ = loss_and_grad("clip_cov", lp, inp, cfg)
    _, grad_again, _ = loss_and_grad("clip_cov", lp, inp, cfg)
    assert torch.equal(grad, grad_again), "selection must be deterministic for a given seed"
    per_token, ppo_grad, clipped = ref_ppo(lp, q, adv, m, 0.8, 1.2)
    cov, s = ref_cov(lp, inp)
    cand = s & ~clipped & (cov > 0.0) & (cov < 5.0)
    k = max(1, int(0.1 * int(s.sum())))
    assert cand.sum() > k
    zeroed = cand & (grad == 0) & (ppo_grad != 0)
    assert int(zeroed.sum()) == k
    assert_close(grad[~zeroed], ppo_grad[~zeroed])
    assert_close(loss, (per_token * m).sum())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("cfg", [None, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}])
def test_kl_cov(seed, weights, cfg):
    lp, inp = make_data(seed, weights=weights)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    ratio_cfg, coef = (0.0002, 1.0) if cfg is None else (cfg["kl_cov_ratio"], cfg["ppo_kl_coef"])
    loss, grad, metrics = loss_and_grad("kl_cov", lp, inp, cfg)
    cov, s = ref_cov(lp, inp)
    k = max(1, int(ratio_cfg * int(s.sum())))
    order = sorted(torch.nonzero(s).flatten().tolist(), key=lambda i: -cov[i].item())
    sel = torch.zeros(N, dtype=torch.bool)
    sel[order[:k]] = True
    r = ratio_of(lp, q)
    kl = sel.float() * coef
    assert_close(loss, ((-r * adv + kl * (lp - q).abs()) * m).sum())
    assert_close(grad, (-r * adv + kl * torch.sign(lp - q)) * m)
    assert metrics["kl_cov_fraction:mean"] == pytest.approx(k / int(s.sum()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_value(seed, weights, clip):
    g = torch.Generator().manual_seed(100 + seed)
    v = torch.randn(N, generator=g)
    v_old = v + torch.randn(N, generator=g) * 0.4
    ret = torch.randn(N, generator=g)
    inp = {"values": v_old, "returns": ret}
    if weights:
        inp["weights"] = (torch.rand(N, generator=g) > 0.3).float() * 1.5
    m = mask_of(inp)
    c = 0.2 if clip is None else clip
    loss, grad, metrics = loss_and_grad("value", v, inp, None if clip is None else {"value_clip": clip})
    v_clip = v_old + torch.clamp(v - v_old, -c, c)
    unclipped, clipped = (v - ret) ** 2, (v_clip - ret) ** 2
    # inside the clip range v_clip == v (up to rounding), so the clipped branch wins only outside it
    inside = (v - v_old).abs() <= c
    took_clipped = ~inside & (clipped > unclipped)
    assert took_clipped.any() and (~took_clipped).any()
    assert_close(loss, 0.5 * (torch.maximum(unclipped, clipped) * m).sum())
    assert_close(grad, torch.where(took_clipped, torch.zeros_like(v), (v - ret) * m))
    s = m != 0
    assert metrics["vf_clip_fraction:mean"] == pytest.approx(took_clipped[s].float().mean().item())
    assert metrics["value_mean:mean"] == pytest.approx(v[s].mean().item(), abs=1e-5)
    assert metrics["vf_loss:sum"] == pytest.approx(loss.item(), rel=1e-5)


def test_cross_entropy_1d_and_topk():
    g = torch.Generator().manual_seed(7)
    lp = -torch.rand(10, generator=g)
    w = (torch.rand(10, generator=g) > 0.3).float()
    loss, grad, _ = loss_and_grad("cross_entropy", lp, {"weights": w})
    assert_close(loss, -(w * lp).sum())
    assert_close(grad, -w)
    lp_k = -torch.rand(10, 4, generator=g)
    w_k = torch.rand(10, 4, generator=g)
    w_k[:3] = 0.0
    tokens = torch.randint(0, 100, (10, 4), generator=g)
    loss, grad, metrics = loss_and_grad("cross_entropy", lp_k, {"target_tokens": tokens, "weights": w_k})
    assert_close(loss, -(w_k * lp_k).sum())
    assert_close(grad, -w_k)
    assert metrics["num_loss_tokens:sum"] == 7


# ---- per-token thresholds and the Tinker dialect --------------------------------------------


def per_token_bounds(seed):
    g = torch.Generator().manual_seed(50 + seed)
    return 0.6 + 0.35 * torch.rand(N, generator=g), 1.05 + 0.45 * torch.rand(N, generator=g)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_per_token_thresholds_override_config(seed):
    lp, inp = make_data(seed, weights=True, spread=0.6)
    q, adv, m = inp["logprobs"], inp["advantages"], mask_of(inp)
    lo, hi = per_token_bounds(seed)
    cfg = {"eps_clip_low": 0.01, "eps_clip_high": 0.01}
    both = {**inp, "clip_low_threshold": lo, "clip_high_threshold": hi}

    loss, grad, _ = loss_and_grad("regular", lp, both, cfg)
    per_token, ref_grad, _ = ref_ppo(lp, q, adv, m, lo, hi)
    assert_close(loss, (per_token * m).sum())
    assert_close(grad, ref_grad)

    # only the high bound sent: the low bound comes from the config
    loss, grad, _ = loss_and_grad("regular", lp, {**inp, "clip_high_threshold": hi}, cfg)
    per_token, ref_grad, _ = ref_ppo(lp, q, adv, m, 0.99, hi)
    assert_close(loss, (per_token * m).sum())
    assert_close(grad, ref_grad)

    loss, grad, _ = loss_and_grad("dual_clip", lp, both, {**cfg, "clip_ratio_c": 1.5})
    per_token, ref_grad, _ = ref_ppo(lp, q, adv, m, lo, hi)
    dual = (adv < 0) & (-1.5 * adv < per_token)
    assert_close(loss, (torch.where(dual, -1.5 * adv, per_token) * m).sum())
    assert_close(grad, torch.where(dual, torch.zeros_like(ref_grad), ref_grad))

    loss, grad, _ = loss_and_grad("cispo", lp, both, {"cispo_eps_clip_low": 0.01, "cispo_eps_clip_high": 0.01})
    weight = torch.min(torch.max(ratio_of(lp, q), lo), hi)
    assert_close(loss, -(adv * weight * lp * m).sum())
    assert_close(grad, -adv * weight * m)

    loss, grad, _ = loss_and_grad("gspo", lp, both, cfg)
    ref_loss, ref_grad, _ = ref_gspo(lp, both, lo, hi, (adv != 0) & (m != 0))
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


TINKER_EQUIVALENTS = [
    ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}, "regular", {"eps_clip_low": 0.3, "eps_clip_high": 0.3}),
    ("ppo", None, "regular", None),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, "gspo", {"eps_clip_low": 0.1, "eps_clip_high": 0.05}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, "cispo", {"cispo_eps_clip_low": 0.5, "cispo_eps_clip_high": 1.0}),
    ("cispo", None, "cispo", {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0}),
    ("dro", {"beta": 0.3}, "dro", {"beta": 0.3}),
    ("dro", None, "dro", {"beta": 0.1}),
    ("importance_sampling", None, "importance_sampling", None),
]


@pytest.mark.parametrize("tinker_name,tinker_cfg,native_name,native_cfg", TINKER_EQUIVALENTS)
@pytest.mark.parametrize("weights", [False, True])
def test_tinker_dialect_matches_native(tinker_name, tinker_cfg, native_name, native_cfg, weights):
    lp, inp = make_data(3, weights=weights, spread=0.6, offset=0.2)
    t_loss, t_grad, t_metrics = loss_and_grad(tinker_name, lp, inp, tinker_cfg, dialect="tinker")
    n_loss, n_grad, n_metrics = loss_and_grad(native_name, lp, inp, native_cfg)
    assert_close(t_loss, n_loss)
    assert_close(t_grad, n_grad)
    assert t_metrics.keys() == n_metrics.keys()


def test_tinker_cispo_default_bounds_are_0_and_5():
    lp, inp = make_data(1, weights=False, spread=1.2)
    q, adv = inp["logprobs"], inp["advantages"]
    loss, grad, _ = loss_and_grad("cispo", lp, inp, dialect="tinker")
    weight = torch.clamp(ratio_of(lp, q), 0.0, 5.0)
    assert (ratio_of(lp, q) > 5.0).any()
    assert_close(loss, -(adv * weight * lp).sum())
    assert_close(grad, -adv * weight)


def test_tinker_cross_entropy_and_critic_ppo():
    lp, inp = make_data(2, weights=True)
    w = inp["weights"]
    loss, grad, _ = loss_and_grad("cross_entropy", lp, {"weights": w}, dialect="tinker")
    assert_close(loss, -(w * lp).sum())
    assert_close(grad, -w)
    v = torch.randn(N)
    critic_in = {"values": v + 0.5, "returns": torch.randn(N)}
    t_loss, t_grad, _ = loss_and_grad("ppo", v, critic_in, {"value_clip": 0.3}, dialect="tinker", role="critic")
    n_loss, n_grad, _ = loss_and_grad("value", v, critic_in, {"value_clip": 0.3})
    assert_close(t_loss, n_loss)
    assert_close(t_grad, n_grad)


def test_convert_tinker_loss_config():
    out = convert_tinker_loss_config({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    assert out.keys() == {"eps_clip_low", "eps_clip_high"}
    assert out["eps_clip_low"] == pytest.approx(0.2)
    assert out["eps_clip_high"] == pytest.approx(0.28)
    assert convert_tinker_loss_config(None) == {}
    import numpy as np

    out = convert_tinker_loss_config({"clip_low_threshold": np.float32(0.75), "clip_high_threshold": np.int64(2)})
    assert out == pytest.approx({"eps_clip_low": 0.25, "eps_clip_high": 1.0})


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_nothing_scored(name):
    """All advantages zero and no weights: zero loss (except dro's KL term), finite metrics."""
    lp, inp = make_data(4, weights=False)
    inp["advantages"] = torch.zeros(N)
    loss, grad, metrics = loss_and_grad(name, lp, inp)
    assert all(math.isfinite(v) for v in metrics.values())
    if name != "dro":
        assert loss.item() == 0.0 and metrics["num_loss_tokens:sum"] == 0
        assert torch.all(grad == 0)


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"clip_low_threshold": 0.8, "clip_high": 1.2}, "clip_high"),
        ({"clip_low_threshold": 1.1}, "clip_low_threshold"),
        ({"clip_low_threshold": -0.1}, "clip_low_threshold"),
        ({"clip_high_threshold": 0.9}, "clip_high_threshold"),
        ({"clip_low_threshold": 1.2, "clip_high_threshold": 1.1}, "clip_low_threshold"),
        ({"clip_low_threshold": "0.8"}, "clip_low_threshold"),
    ],
)
def test_convert_tinker_loss_config_errors(cfg, key):
    with pytest.raises(ValueError, match=key):
        convert_tinker_loss_config(cfg)


@pytest.mark.parametrize(
    "name,cfg,key",
    [
        ("ppo", {"clip_low_threshold": 0.8, "eps_clip_low": 0.2}, "eps_clip_low"),
        ("ppo", {"clip_high_threshold": 0.95}, "clip_high_threshold"),
        ("ppo", {"clip_low_threshold": 1.05}, "clip_low_threshold"),
        ("gspo", {"clip_high_threshold": 0.5}, "clip_high_threshold"),
        ("cispo", {"clip_low_threshold": 2.0}, "clip_low_threshold"),
        ("dro", {"beta": -1.0}, "beta"),
        ("dro", {"clip_low_threshold": 0.8}, "clip_low_threshold"),
        ("importance_sampling", {"beta": 0.1}, "beta"),
        ("cross_entropy", {"eps_clip_low": 0.2}, "eps_clip_low"),
    ],
)
def test_tinker_config_errors(name, cfg, key):
    lp, inp = make_data(0, weights=False)
    if name == "cross_entropy":
        inp = {}
    with pytest.raises(ValueError, match=key):
        evaluate_loss(name, lp, inp, cfg, dialect="tinker")


@pytest.mark.parametrize(
    "name,cfg,key",
    [
        ("regular", {"bogus": 1.0}, "bogus"),
        ("regular", {"eps_clip_low": -0.1}, "eps_clip_low"),
        ("regular", {"eps_clip_low": 1.5}, "eps_clip_low"),
        ("regular", {"eps_clip_high": -0.2}, "eps_clip_high"),
        ("regular", {"eps_clip_high": float("nan")}, "eps_clip_high"),
        ("regular", {"eps_clip_high": True}, "eps_clip_high"),
        ("gspo", {"eps_clip_low": "x"}, "eps_clip_low"),
        ("dual_clip", {"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ("cispo", {"cispo_eps_clip_low": -1.0}, "cispo_eps_clip_low"),
        ("cispo", {"cispo_eps_clip_high": -1.0}, "cispo_eps_clip_high"),
        ("sapo", {"tau_pos": 0.0}, "tau_pos"),
        ("sapo", {"tau_neg": -1.0}, "tau_neg"),
        ("dro", {"beta": -0.1}, "beta"),
        ("clip_cov", {"clip_ratio": -0.1}, "clip_ratio"),
        ("clip_cov", {"clip_cov_lb": 6.0}, "clip_cov_lb"),
        ("clip_cov", {"seed": 1.5}, "seed"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef"),
        ("kl_cov", {"kl_cov_ratio": 2.0}, "kl_cov_ratio"),
        ("value", {"value_clip": 0.0}, "value_clip"),
        ("importance_sampling", {"eps_clip_low": 0.2}, "eps_clip_low"),
        ("cross_entropy", {"beta": 0.2}, "beta"),
    ],
)
def test_native_config_errors(name, cfg, key):
    lp, inp = make_data(0, weights=False)
    if name == "cross_entropy":
        inp = {}
    if name == "value":
        inp = {"values": torch.zeros(N), "returns": torch.zeros(N)}
    with pytest.raises(ValueError, match=key):
        evaluate_loss(name, lp, inp, cfg)


def test_unknown_loss_lists_available():
    lp, inp = make_data(0, weights=False)
    with pytest.raises(ValueError) as info:
        evaluate_loss("no_such_loss", lp, inp, dialect="tinker")
    message = str(info.value)
    assert "no_such_loss" in message
    for name in ("ppo", "regular", "gspo", "cispo", "cross_entropy"):
        assert name in message
    with pytest.raises(ValueError, match="regular"):
        evaluate_loss("no_such_loss", lp, inp)


def test_missing_and_unknown_inputs():
    lp, inp = make_data(0, weights=False)
    with pytest.raises(ValueError, match="advantages"):
        evaluate_loss("regular", lp, {"logprobs": inp["logprobs"]})
    with pytest.raises(ValueError, match="sequence_ratio_mask"):
        evaluate_loss("regular", lp, {**inp, "sequence_ratio_mask": torch.ones(N)})


# ---- metric keys ----------------------------------------------------------------------------


def _example_inputs(name):
    lp, inp = make_data(5, weights=True)
    if name == "cross_entropy":
        return lp, {"weights": inp["weights"]}
    if name == "value":
        return lp, {"values": lp + 0.3, "returns": torch.zeros(N), "weights": inp["weights"]}
    return lp, inp


@pytest.mark.parametrize("name", ALL_BUILTIN)
def test_metric_keys_have_one_colon(name):
    lp, inp = _example_inputs(name)
    _, metrics = evaluate_loss(name, lp.clone().requires_grad_(True), inp, entropy=torch.rand(N))
    assert "loss:sum" in metrics and "total_loss:sum" in metrics and "entropy_loss:sum" in metrics
    assert "num_loss_tokens:sum" in metrics
    if name in POLICY_LOSSES:
        for key in ("pg_loss:sum", "clip_fraction:mean", "ratio_max:max", "ratio_min:min",
                    "ratio_mean:mean", "kl_sample_train:mean"):
            assert key in metrics
    for key, value in metrics.items():
        assert key.count(":") == 1 and key.split(":")[1] in ("sum", "mean", "min", "max"), key
        assert math.isfinite(value), key


# ---- micro-batch invariance -----------------------------------------------------------------

SEGMENT_LENGTHS = (11, 17, 14)


def packed_data(seed, *, weights: bool, offsets=(-0.4, 0.0, 0.4)):
    """Three datums of different lengths (and different sequence ratios), concatenated."""
    parts = [make_data(seed * 10 + i, weights=weights, n=n, offset=o)
             for i, (n, o) in enumerate(zip(SEGMENT_LENGTHS, offsets, strict=True))]
    for _, inp in parts:
        inp["advantages"][:3] = 0.0
        inp["logprobs"][:3] = 0.0
    lp = torch.cat([p[0] for p in parts])
    inputs = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
    seg = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(SEGMENT_LENGTHS)])
    return lp, inputs, seg


def run_packed(name, cfg, lp, inputs, seg, role="policy", prepared=None):
    """run_loss on a packed LossInput; returns (loss, grad, metric accumulator state)."""
    resolved = get_registry().resolve(name, cfg, dialect="native", role=role)
    leaf = lp.clone().requires_grad_(True)
    segs = torch.unique(seg)
    ids = torch.searchsorted(segs, seg)
    tensors = dict(inputs, **(prepared or {}))
    kw = {"values": leaf} if role == "critic" else {"target_logprobs": leaf}
    loss_input = LossInput(inputs=tensors, segment_ids=ids, num_segments=len(segs), **kw)
    out, metrics = run_loss(resolved, loss_input)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    assert torch.allclose(out.elementwise_loss.sum(), out.loss.detach(), atol=1e-5)
    return out.loss.detach(), grad, metrics


def _merged(metric_list):
    acc = MetricAccumulator()
    for m in metric_list:
        acc.add(m)
    return acc.result()


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in ("clip_cov", "kl_cov")] + ["value"])
@pytest.mark.parametrize("weights", [False, True])
def test_segment_invariance(name, weights):
    """Loss, gradient and metrics of the packed batch == the sum over each datum alone."""
    lp, inputs, seg = packed_data(1, weights=weights)
    role = "policy"
    if name == "value":
        role = "critic"
        inputs = {"values": lp + 0.3 * inputs["logprobs"], "returns": inputs["advantages"],
                  **({"weights": inputs["weights"]} if weights else {})}
    whole_loss, whole_grad, whole_metrics = run_packed(name, None, lp, inputs, seg, role)
    losses, grads, metrics = [], [], []
    for i in range(len(SEGMENT_LENGTHS)):
        sel = seg == i
        part = {k: v[sel] for k, v in inputs.items()}
        loss, grad, m = run_packed(name, None, lp[sel], part, seg[sel], role)
        losses.append(loss)
        grads.append(grad)
        metrics.append(m)
        # evaluate_loss on one datum agrees with run_loss on that datum alone
        e_loss, _ = evaluate_loss(name, lp[sel], part)
        assert_close(e_loss, loss)
    assert_close(whole_loss, sum(losses))
    assert_close(whole_grad, torch.cat(grads))
    merged = _merged(metrics)
    for key, value in _merged([whole_metrics]).items():
        assert merged[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_gspo_packing_reduces_per_segment():
    """A whole-batch mean would mix datums; the packed loss must match per-datum GSPO."""
    lp, inputs, seg = packed_data(2, weights=False)
    whole_loss, whole_grad, _ = run_packed("gspo", None, lp, inputs, seg)
    ref_losses, ref_grads = [], []
    for i in range(3):
        sel = seg == i
        part = {k: v[sel] for k, v in inputs.items()}
        loss, grad, _ = ref_gspo(lp[sel], part, 0.8, 1.2, part["advantages"] != 0)
        ref_losses.append(loss)
        ref_grads.append(grad)
    assert_close(whole_loss, sum(ref_losses))
    assert_close(whole_grad, torch.cat(ref_grads))


@pytest.mark.parametrize("name,cfg", [
    ("clip_cov", {"clip_ratio": 0.25, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}),
    ("kl_cov", {"kl_cov_ratio": 0.25}),
])
@pytest.mark.parametrize("weights", [False, True])
def test_cov_losses_prepare_whole_call_then_split(name, cfg, weights):
    lp, inputs, seg = packed_data(3, weights=weights)
    inputs["advantages"] = inputs["advantages"] * 3.0
    spec = get_registry().losses[name]
    resolved = get_registry().resolve(name, cfg, dialect="native")
    whole = LossInput(inputs=inputs, segment_ids=seg, num_segments=3, target_logprobs=lp.detach())
    prepared = spec.prepare(whole, resolved.config)
    key = f"{name}_selected"
    assert set(prepared) == {key} and prepared[key].shape == lp.shape and prepared[key].sum() >= 2
    whole_loss, whole_grad, whole_metrics = run_packed(name, cfg, lp, inputs, seg, prepared=prepared)
    groups = [seg == 0, seg != 0]
    losses, grads, metrics = [], [], []
    for sel in groups:
        part = {k: v[sel] for k, v in inputs.items()}
        loss, grad, m = run_packed(name, cfg, lp[sel], part, seg[sel], prepared={key: prepared[key][sel]})
        losses.append(loss)
        grads.append(grad)
        metrics.append(m)
    assert_close(whole_loss, sum(losses))
    assert_close(whole_grad, torch.cat(grads))
    assert _merged(metrics)[f"{name}_fraction:mean"] == pytest.approx(whole_metrics[f"{name}_fraction:mean"].value / whole_metrics[f"{name}_fraction:mean"].weight)
    # and the prepared selection equals what evaluate_loss-style prepare on the whole call gives
    # (clip_cov's selection only detaches tokens, so the gradient is what tells selections apart)
    loss_direct, grad_direct, _ = run_packed(name, cfg, lp, inputs, seg)
    assert_close(loss_direct, whole_loss)
    assert_close(grad_direct, whole_grad)
