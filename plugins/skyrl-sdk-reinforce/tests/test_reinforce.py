"""The example plugin, checked the way a plugin author would: against an independent
reference, through ``evaluate_loss``, in both dialects, found through its entry point."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

pytest.importorskip("skyrl_sdk_reinforce", reason="pip install -e plugins/skyrl-sdk-reinforce")

from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import errors, evaluate_loss


def _case(n: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=gen, dtype=torch.float64).float() * 3
    adv = torch.randn(n, generator=gen)
    weights = (torch.rand(n, generator=gen) > 0.3).float()
    return lp, adv, weights


def _reference(lp, adv, weights):
    """Loss and d loss / d lp written out by hand (no autograd, no skyrl code)."""
    value = -sum(float(a) * float(x) * float(w) for a, x, w in zip(adv, lp, weights, strict=True))
    grad = [-float(a) * float(w) for a, w in zip(adv, weights, strict=True)]
    return value, torch.tensor(grad)


@pytest.fixture(autouse=True)
def _fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


def test_registered_through_its_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="skyrl_sdk") if ep.name == "reinforce"]
    assert [ep.value for ep in eps] == ["skyrl_sdk_reinforce"]
    info = next(p for p in plugins.get_plugins().plugins if p.name == "reinforce")
    assert (info.package, info.builtin, info.error) == ("skyrl-sdk-reinforce", False, None)
    assert info.registered == ("loss:reinforce",)
    spec = plugins.get_registry().losses["reinforce"]
    assert spec.required_inputs == ("target_tokens", "advantages")
    assert spec.optional_inputs == ("weights", "logprobs")  # logprobs: datum_from_sample's datums fit
    assert spec.role == "policy" and spec.config_cls is None


@pytest.mark.parametrize("dialect", ["native", "tinker"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_reference(dialect, seed):
    lp, adv, weights = _case(seed=seed)
    want_value, want_grad = _reference(lp, adv, weights)
    x = lp.clone().requires_grad_(True)
    loss, metrics = evaluate_loss("reinforce", x, {"advantages": adv, "weights": weights}, dialect=dialect)
    loss.backward()
    assert loss.item() == pytest.approx(want_value, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-6, atol=1e-7)
    assert metrics["pg_loss:sum"] == pytest.approx(want_value, rel=1e-5, abs=1e-6)
    assert metrics["loss:sum"] == pytest.approx(want_value, rel=1e-5, abs=1e-6)
    assert metrics["num_loss_tokens:sum"] == float((weights != 0).sum())


def test_weights_are_optional():
    lp, adv, _ = _case()
    want_value, want_grad = _reference(lp, adv, torch.ones_like(adv))
    x = lp.clone().requires_grad_(True)
    loss, metrics = evaluate_loss("reinforce", x, {"advantages": adv.tolist()})
    loss.backward()
    assert loss.item() == pytest.approx(want_value, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(x.grad, want_grad)
    assert metrics["num_loss_tokens:sum"] == float((adv != 0).sum())


def test_without_weights_zero_advantage_positions_are_not_loss_tokens():
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.25])
    loss, metrics = evaluate_loss("reinforce", lp, {"advantages": [0.0, 0.0, 2.0, -1.0]})
    assert loss.item() == pytest.approx(-(2.0 * -0.5 + -1.0 * -0.25))
    assert metrics["num_loss_tokens:sum"] == 2


def test_missing_advantages_is_an_input_error():
    lp, _, weights = _case()
    with pytest.raises(errors.DatumError, match="advantages"):
        evaluate_loss("reinforce", lp, {"weights": weights})


@pytest.mark.parametrize("dialect", ["native", "tinker"])
def test_takes_no_config(dialect):
    lp, adv, _ = _case()
    with pytest.raises(errors.LossConfigError, match="reinforce"):
        evaluate_loss("reinforce", lp, {"advantages": adv}, config={"beta": 1.0}, dialect=dialect)


def test_through_backend_forward_backward():
    """End to end: the plugin's loss under the real engine, compared with forward logprobs."""
    pytest.importorskip("skyrl_sdk.backend", reason="the Backend is not written yet")
    import skyrl_sdk
    from skyrl_sdk import types

    tokens = list(range(3, 15))
    adv = [0.0] * 4 + [1.5, -0.5, 2.0, 1.0, -1.0, 0.5, 0.25, 1.0]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "advantages": adv[1:]},
    )
    with skyrl_sdk.Backend(model="tiny", seed=0) as backend:
        fwd = backend.forward([datum], loss_fn="reinforce")
        out = backend.forward_backward([datum], loss_fn="reinforce")
    lp = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()
    want = -float((torch.tensor(adv[1:]) * torch.from_numpy(lp)).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert out.metrics["pg_loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert set(out.loss_fn_outputs[0]) >= {"logprobs", "elementwise_loss"}
    elementwise = out.loss_fn_outputs[0]["elementwise_loss"].to_numpy()
    torch.testing.assert_close(torch.from_numpy(elementwise), -torch.tensor(adv[1:]) * torch.from_numpy(lp),
                               rtol=1e-4, atol=1e-5)
