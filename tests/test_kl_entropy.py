"""KL-to-reference (kl_coef, kl_estimator, ref_logprobs) and the entropy bonus (entropy_coef):
values and gradients against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.evaluate import evaluate_loss
from skyrl_sdk.losses.terms import kl_estimate
from skyrl_sdk.models.loading import load_model
from skyrl_sdk.models.logprobs import target_logprobs
from skyrl_sdk.testing import assert_tensors_close, count_micro_batches, grads_of, make_rl_data

LP = np.array([-0.3, -2.0, -0.01, -5.0, -1.0, -30.0, -0.5], dtype=np.float64)
REF = np.array([-0.5, -1.0, -0.02, -1.0, -1.0, -0.1, -28.0], dtype=np.float64)


def numpy_kl(lp, ref, estimator):
    d = lp - ref
    if estimator == "k1":
        return d, np.ones_like(d)
    if estimator == "abs":
        return np.abs(d), np.sign(d)
    if estimator == "k2":
        return 0.5 * d * d, d
    # k3 = low_var_kl: x = clip(ref - lp, -20, 20); kl = clip(e^x - x - 1, -10, 10)
    x = np.clip(ref - lp, -20, 20)
    raw = np.exp(x) - x - 1
    value = np.clip(raw, -10, 10)
    grad = np.where((np.abs(ref - lp) < 20) & (raw < 10), 1.0 - np.exp(x), 0.0)  # d/dlp of e^x - x - 1
    return value, grad


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_estimators_values_and_gradients(estimator):
    lp = torch.tensor(LP, dtype=torch.float32, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float32)
    value = kl_estimate(lp, ref, estimator)
    value.sum().backward()
    expected, grad = numpy_kl(LP, REF, estimator)
    np.testing.assert_allclose(value.detach().numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lp.grad.numpy(), grad, rtol=1e-5, atol=1e-5)
    if estimator in ("k3", "low_var_kl"):
        assert float(value.detach().max()) == pytest.approx(10.0) and bool((value >= 0).all())  # the clamp holds


@pytest.mark.parametrize("reduction", ["sum", "token_mean"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_on_a_loss_with_zero_advantages(estimator, reduction):
    """With A = 0 the policy part is 0: loss = kl_coef * reduce(m * kl), gradient likewise."""
    n = len(LP)
    w = np.array([1, 1, 0, 1, 1, 1, 1], dtype=np.float32)
    lp = torch.tensor(LP, dtype=torch.float32, requires_grad=True)
    inputs = {"logprobs": LP - 0.1, "advantages": np.zeros(n), "weights": w, "ref_logprobs": REF}
    cfg = {"kl_coef": 0.3, "kl_estimator": estimator, "loss_reduction": reduction}
    loss, metrics = evaluate_loss("importance_sampling", lp, inputs, cfg)
    loss.backward()
    value, grad = numpy_kl(LP, REF, estimator)
    denom = w.sum() if reduction == "token_mean" else 1.0
    assert float(loss.detach()) == pytest.approx(0.3 * (value * w).sum() / denom, rel=1e-5)
    assert metrics["kl_loss:sum"] == pytest.approx((value * w).sum() / denom, rel=1e-5)
    np.testing.assert_allclose(lp.grad.numpy(), 0.3 * grad * w / denom, rtol=1e-5, atol=1e-6)


def test_entropy_gradient_of_every_scoring_path():
    """target_logprobs' entropy carries d H / d logits exactly: fused, generic and chunked heads."""
    torch.manual_seed(0)
    t, h, v = 7, 5, 11
    lin = torch.nn.Linear(h, v)

    class PlainHead(torch.nn.Module):  # the fused path: a bare nn.Linear
        scale = softcap = None

        def __init__(self):
            super().__init__()
            self.proj = lin

        def forward(self, x):
            return lin(x)

    def generic_head(x):  # anything else takes autograd through the head
        return lin(x)

    targets = torch.randint(0, v, (t,))
    a, b = torch.randn(t), torch.randn(t)
    for head in (PlainHead(), generic_head):
        for chunk_elements in (2**27, 20):
            hidden = torch.randn(t, h).requires_grad_()
            lp, ent = target_logprobs(hidden, head, targets, v, chunk_elements=chunk_elements)
            (a * lp + b * ent).sum().backward()
            got = (hidden.grad.clone(), lin.weight.grad.clone())
            hidden.grad = lin.weight.grad = lin.bias.grad = None
            logp = F.log_softmax(lin(hidden).double(), -1)
            ref_lp = logp.gather(1, targets[:, None])[:, 0]
            ref_ent = -(logp.exp() * logp).sum(-1)
            (a.double() * ref_lp + b.double() * ref_ent).sum().backward()
            torch.testing.assert_close(ent.detach().double(), ref_ent.detach(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[0].double(), hidden.grad.double(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got[1].double(), lin.weight.grad.double(), atol=1e-6, rtol=1e-5)
            lin.weight.grad = lin.bias.grad = None


def rl_data(seed):
    data = make_rl_data([9, 14, 5, 21, 11], seed=seed)
    rng = np.random.default_rng(seed)
    for d in data:
        n = d.model_input.length
        d.loss_fn_inputs["weights"] = types.TensorData((d.loss_fn_inputs["advantages"].array != 0).astype(np.float32))
        d.loss_fn_inputs["ref_logprobs"] = types.TensorData(
            (d.loss_fn_inputs["logprobs"].array + 0.3 * rng.normal(size=n)).astype(np.float32))
    return data


def hf_reference(data, *, kl_coef, entropy_coef):
    """token_mean PPO + kl_coef * k3 KL - entropy_coef * entropy, by plain autograd on the HF model."""
    model = load_model("tiny", seed=0).module
    pg, kl, ent, masks = [], [], [], []
    for d in data:
        ids = torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)
        logp_all = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        inp = {k: torch.from_numpy(v.array) for k, v in d.loss_fn_inputs.items()}
        lp = logp_all.gather(1, inp["target_tokens"].unsqueeze(1)).squeeze(1)
        m = inp["weights"]
        ratio = torch.exp(lp - inp["logprobs"])
        adv = inp["advantages"]
        pg.append((torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * m).sum())
        x = inp["ref_logprobs"] - lp
        kl.append(((torch.exp(x) - x - 1) * m).sum())
        ent.append((-(logp_all.exp() * logp_all).sum(-1) * m).sum())
        masks.append(float(m.sum()))
    n_tokens = sum(masks)
    pg_loss, kl_loss, entropy = sum(pg) / n_tokens, sum(kl) / n_tokens, sum(ent) / n_tokens
    total = pg_loss + kl_coef * kl_loss - entropy_coef * entropy
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(total.detach()), "pg": float(pg_loss.detach()), "kl": float(kl_loss.detach())}, grads


def test_kl_and_entropy_terms_match_autograd_on_the_hf_model():
    data = rl_data(seed=11)
    cfg = {"loss_reduction": "token_mean", "kl_coef": 0.2, "kl_estimator": "low_var_kl", "entropy_coef": 0.05}
    ref, ref_grads = hf_reference(data, kl_coef=0.2, entropy_coef=0.05)
    no_bonus, _ = hf_reference(data, kl_coef=0.2, entropy_coef=0.0)
    assert abs(ref["loss"] - no_bonus["loss"]) > 1e-3  # the entropy bonus is visible in the loss
    for engine_config, split in (({"micro_batch_tokens": 100000}, False), ({"micro_batch_tokens": 1}, True)):
        with skyrl_sdk.Backend(seed=0, engine_config=engine_config) as backend, count_micro_batches() as boundaries:
            out = backend.forward_backward(data, "ppo", cfg)
            assert (boundaries[0] > 0) == split  # one datum per micro-batch, or all in one
            assert out.metrics["loss:sum"] == pytest.approx(ref["loss"], rel=2e-5)
            assert out.metrics["pg_loss:sum"] == pytest.approx(ref["pg"], rel=2e-5)
            assert out.metrics["kl_loss:sum"] == pytest.approx(ref["kl"], rel=2e-5)
            assert_tensors_close(grads_of(backend), ref_grads, atol=2e-5, rtol=1e-4)


def test_kl_inputs_and_config_are_validated():
    data = rl_data(seed=12)
    without_ref = [types.Datum(model_input=d.model_input,
                               loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "ref_logprobs"})
                   for d in data]
    with skyrl_sdk.Backend(seed=0) as backend:
        with pytest.raises(errors.DatumError, match="requires input 'ref_logprobs'") as info:
            backend.forward_backward(without_ref, "ppo", {"kl_coef": 0.1})
        assert "datum 0" in str(info.value)
        with pytest.raises(errors.DatumError, match="ref_logprobs"):  # sent, but no KL term asks for it
            backend.forward_backward(data, "ppo")
        for cfg, match in (({"kl_coef": -0.1}, "kl_coef: expected a value >= 0"),
                           ({"kl_coef": 0.1, "kl_estimator": "k4"}, "kl_estimator: expected one of"),
                           ({"entropy_coef": "0.1"}, "entropy_coef: expected a finite number")):
            with pytest.raises(errors.LossConfigError, match=match):
                backend.forward_backward(data, "ppo", cfg)
        topk = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                           loss_fn_inputs={"target_tokens": np.array([[4, 5], [6, 7], [8, 9]]),
                                           "weights": np.ones((3, 2), dtype=np.float32),
                                           "ref_logprobs": np.zeros(3, dtype=np.float32)})
        with pytest.raises(errors.DatumError, match="top-K targets"):
            backend.forward_backward([topk], "cross_entropy", {"kl_coef": 0.1})
        assert grads_of(backend) == {}
