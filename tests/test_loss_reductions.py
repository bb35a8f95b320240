"""loss_reduction: each reduction against its formula, computed independently from the HF model,
for several micro-batch layouts and for the fsdp engine with 2 ranks (every reduction, KL and entropy terms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.engines.throughput import without_throughput
from skyrl_sdk.models.loading import load_model
from skyrl_sdk.testing import assert_tensors_close, count_micro_batches, grads_of, make_rl_data, make_sft_data

REDUCTIONS = ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
MAX_SEQ_LEN = 32
LAYOUTS = {
    "whole": {"micro_batch_tokens": 100000},
    "packed": {"micro_batch_tokens": 22, "batching": "pack"},
    "one_each": {"micro_batch_tokens": 1},
}


def config_for(reduction: str, **extra) -> dict:
    cfg = {"loss_reduction": reduction, **extra}
    if reduction == "seq_mean_token_sum_norm":
        cfg["max_seq_len"] = MAX_SEQ_LEN
    return cfg


def rl_data_with_weights(lengths, seed):
    data = make_rl_data(lengths, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for d in data:
        n = d.model_input.length
        d.loss_fn_inputs["weights"] = types.TensorData((rng.random(n) > 0.25).astype(np.float32))
    return data


def reduce_reference(per_token: list[torch.Tensor], masks: list[np.ndarray], reduction: str) -> torch.Tensor:
    """The formulas of the issue, written directly (per-token losses already times the mask)."""
    b = len(per_token)
    if reduction == "sum":
        return sum(x.sum() for x in per_token)
    if reduction == "token_mean":
        return sum(x.sum() for x in per_token) / float(sum(m.sum() for m in masks))
    if reduction == "seq_mean_token_mean":
        return sum(x.sum() / float(m.sum()) for x, m in zip(per_token, masks, strict=True)) / b
    if reduction == "seq_mean_token_sum":
        return sum(x.sum() for x in per_token) / b
    if reduction == "seq_mean_token_sum_norm":
        return sum(x.sum() for x in per_token) / b / MAX_SEQ_LEN
    raise AssertionError(reduction)


def ppo_per_token(lp, inputs, lo=0.8, hi=1.2):
    q = torch.from_numpy(inputs["logprobs"])
    adv = torch.from_numpy(inputs["advantages"])
    ratio = torch.exp(lp - q)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi)) * torch.from_numpy(inputs["weights"])


def ce_per_token(lp, inputs):
    return -lp * torch.from_numpy(inputs["weights"])


def reference(data, per_token_fn, reduction):
    """(loss, grads by parameter name) from a fresh seed-0 HF model, one datum at a time."""
    model = load_model("tiny", seed=0).module
    per_token, masks = [], []
    for d in data:
        ids = torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)
        logits = model(input_ids=ids).logits[0].float()
        tgt = torch.from_numpy(d.loss_fn_inputs["target_tokens"].array)
        lp = torch.log_softmax(logits, -1).gather(1, tgt.unsqueeze(1)).squeeze(1)
        inputs = {k: v.array for k, v in d.loss_fn_inputs.items()}
        per_token.append(per_token_fn(lp, inputs))
        masks.append(inputs["weights"])
    loss = reduce_reference(per_token, masks, reduction)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.fixture(scope="module")
def backends():
    made = {name: skyrl_sdk.Backend(seed=0, engine_config=cfg) for name, cfg in LAYOUTS.items()}
    yield made
    for b in made.values():
        b.close()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("loss_fn", ["ppo", "cross_entropy"])
def test_reduction_matches_formula_for_every_micro_batching(backends, loss_fn, reduction):
    if loss_fn == "ppo":
        data, fn = rl_data_with_weights([9, 14, 5, 21, 11], seed=2), ppo_per_token
    else:
        data, fn = make_sft_data([7, 12, 3, 20, 9], seed=1), ce_per_token
    ref_loss, ref_grads = reference(data, fn, reduction)
    for name, backend in backends.items():
        backend.zero_grad()
        with count_micro_batches() as boundaries:
            out = backend.forward_backward(data, loss_fn, config_for(reduction))
        assert (boundaries[0] == 0) == (name == "whole"), name  # the other layouts cut the call
        assert out.metrics["loss:sum"] == pytest.approx(ref_loss, rel=2e-5, abs=1e-6), name
        assert out.metrics["total_loss:sum"] == pytest.approx(ref_loss, rel=2e-5, abs=1e-6), name
        if loss_fn == "ppo":  # the policy part is the whole loss here
            assert out.metrics["pg_loss:sum"] == pytest.approx(ref_loss, rel=2e-5, abs=1e-6), name
        assert_tensors_close(grads_of(backend), ref_grads, atol=2e-5, rtol=1e-4)
        # elementwise_loss stays the unreduced per-token loss
        for d, o in zip(data, out.loss_fn_outputs, strict=True):
            lp = torch.from_numpy(o["logprobs"].to_numpy())
            expected = fn(lp, {k: v.array for k, v in d.loss_fn_inputs.items()})
            np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), expected.numpy(), atol=2e-5, rtol=1e-5)
        backend.zero_grad()


def test_global_normalizers_make_split_calls_equal_one_call(backends):
    """verl's global token count: a mini-batch sent in two calls, normalized over all of it."""
    data = rl_data_with_weights([9, 14, 5, 21, 11], seed=5)
    backend = backends["packed"]
    whole = backend.forward_backward(data, "ppo", {"loss_reduction": "token_mean"})
    g_whole = grads_of(backend)
    backend.zero_grad()
    total_tokens = float(sum(d.loss_fn_inputs["weights"].array.sum() for d in data))
    first = backend.forward_backward(data[:2], "ppo", {"loss_reduction": "token_mean",
                                                       "num_tokens_normalizer": total_tokens})
    second = backend.forward_backward(data[2:], "ppo", {"loss_reduction": "token_mean",
                                                        "num_tokens_normalizer": total_tokens})
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)
    assert_tensors_close(grads_of(backend), g_whole, atol=2e-6, rtol=1e-4)
    backend.zero_grad()
    for reduction in ("seq_mean_token_mean", "seq_mean_token_sum"):
        one = backend.forward_backward(data, "ppo", {"loss_reduction": reduction})
        g_one = grads_of(backend)
        backend.zero_grad()
        parts = [backend.forward_backward(part, "ppo", {"loss_reduction": reduction, "num_sequences_normalizer": 5})
                 for part in (data[:3], data[3:])]
        assert sum(p.metrics["loss:sum"] for p in parts) == pytest.approx(one.metrics["loss:sum"], rel=1e-5)
        assert_tensors_close(grads_of(backend), g_one, atol=2e-6, rtol=1e-4)
        backend.zero_grad()


@pytest.mark.parametrize("config, match", [
    ({"loss_reduction": "mean"}, "loss_reduction: expected one of"),
    ({"loss_reduction": "seq_mean_token_sum_norm"}, "needs max_seq_len"),
    ({"loss_reduction": "token_mean", "max_seq_len": 8}, "max_seq_len is only used by"),
    ({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 0}, "max_seq_len: expected an integer > 0"),
    ({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 8.0}, "max_seq_len: expected an integer"),
    ({"loss_reduction": "token_mean", "num_sequences_normalizer": 4}, "num_sequences_normalizer is only used by"),
    ({"loss_reduction": "sum", "num_tokens_normalizer": 4}, "num_tokens_normalizer is only used by"),
    ({"loss_reduction": "token_mean", "num_tokens_normalizer": 0}, "num_tokens_normalizer: expected a value > 0"),
    ({"loss_reduction": "token_mean", "num_tokens_normalizer": True}, "num_tokens_normalizer: expected a finite"),
    ({"loss_reduction": "token_mean", "beta": 1.0}, "unknown loss_fn_config key 'beta'"),
])
def test_bad_reduction_configs_name_the_key_and_leave_no_trace(backends, config, match):
    backend = backends["whole"]
    data = rl_data_with_weights([5, 6], seed=3)
    with pytest.raises(errors.LossConfigError, match=match):
        backend.forward_backward(data, "ppo", config)
    assert grads_of(backend) == {}


def test_loss_terms_pass_through_the_tinker_conversion():
    from skyrl_sdk.losses.dialects import convert_tinker_loss_config

    out = convert_tinker_loss_config({"clip_low_threshold": 0.8, "loss_reduction": "token_mean", "kl_coef": 0.1})
    assert out == {"eps_clip_low": pytest.approx(0.2), "loss_reduction": "token_mean", "kl_coef": 0.1}
    with pytest.raises(errors.LossConfigError, match="unknown loss_fn_config key 'foo'"):
        convert_tinker_loss_config({"foo": 1})


def test_plugin_loss_with_elementwise_loss_gets_reductions():
    """A plugin loss that returns a differentiable elementwise_loss gets every reduction."""
    from skyrl_sdk.evaluate import evaluate_loss
    from skyrl_sdk.losses import LossOutput
    from skyrl_sdk.plugins.registry import Registry

    def weighted_neg_lp(batch, config):
        per_token = -batch.target_logprobs * batch.mask()
        return LossOutput(loss=per_token.sum(), elementwise_loss=per_token)

    def sum_only(batch, config):
        per_token = -batch.target_logprobs * batch.mask()
        return LossOutput(loss=per_token.sum())

    registry = Registry()
    from skyrl_sdk.losses.dialects import convert_native

    registry.register_dialect("test", "native", convert_native)
    registry.register_loss("test", "neg_lp", weighted_neg_lp, description="", required_inputs=(),
                           optional_inputs=("weights",), outputs=("logprobs", "elementwise_loss"))
    registry.register_loss("test", "sum_only", sum_only, description="", required_inputs=(),
                           optional_inputs=("weights",))
    from unittest import mock

    lp0 = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    w = torch.tensor([1.0, 0.0, 1.0, 1.0])
    with mock.patch("skyrl_sdk.builtin_plugins.get_registry", return_value=registry):
        for name in ("neg_lp", "sum_only"):
            for reduction, expected in (("token_mean", 4.5 / 3), ("seq_mean_token_sum", 4.5),
                                        ("seq_mean_token_sum_norm", 4.5 / 8)):
                lp = lp0.clone().requires_grad_()
                cfg = config_for(reduction)
                if reduction == "seq_mean_token_sum_norm":
                    cfg["max_seq_len"] = 8
                loss, _ = evaluate_loss(name, lp, {"weights": w}, cfg)
                loss.backward()
                assert float(loss.detach()) == pytest.approx(expected)
                scale = expected / 4.5
                torch.testing.assert_close(lp.grad, -w * scale)
        lp = lp0.clone().requires_grad_()
        loss, _ = evaluate_loss("neg_lp", lp, {"weights": w}, {"loss_reduction": "seq_mean_token_mean"})
        assert float(loss.detach()) == pytest.approx(4.5 / 3)
        with pytest.raises(errors.LossConfigError, match="does not declare elementwise_loss"):
            evaluate_loss("sum_only", lp0.clone().requires_grad_(), {"weights": w},
                          {"loss_reduction": "seq_mean_token_mean"})


# ---- critic -------------------------------------------------------------------------------


def critic_data(lengths, seed):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(rng.integers(0, 256, n)),
            loss_fn_inputs={"values": rng.normal(size=n).astype(np.float32) * 0.1,
                            "returns": rng.normal(size=n).astype(np.float32),
                            "weights": (rng.random(n) > 0.3).astype(np.float32)},
        ))
    return out


def test_critic_default_loss_is_value_and_skyrl_alias_and_reductions():
    data = critic_data([6, 9, 4], seed=7)
    with skyrl_sdk.Backend(role="critic", seed=0) as tinker, \
            skyrl_sdk.Backend(role="critic", seed=0, dialect="native") as native:
        default = tinker.forward_backward(data)
        g_default = grads_of(tinker)
        tinker.zero_grad()
        explicit = tinker.forward_backward(data, "ppo")
        assert without_throughput(default.metrics) == pytest.approx(without_throughput(explicit.metrics))
        assert_tensors_close(grads_of(tinker), g_default, atol=0.0)
        tinker.zero_grad()
        alias = native.forward_backward(data, "ppo_critic_loss", {"value_clip": 0.2})
        assert alias.metrics["loss:sum"] == pytest.approx(default.metrics["loss:sum"], rel=1e-6)
        assert_tensors_close(grads_of(native), g_default, atol=1e-7)
        native.zero_grad()
        # SkyRL's critic reduces per sequence: a mean over each datum's masked tokens, then over datums
        mean = native.forward_backward(data, "value", {"loss_reduction": "seq_mean_token_mean"})
        per_datum = [o["elementwise_loss"].to_numpy().sum() / d.loss_fn_inputs["weights"].array.sum()
                     for d, o in zip(data, mean.loss_fn_outputs, strict=True)]
        assert mean.metrics["loss:sum"] == pytest.approx(np.mean(per_datum), rel=1e-5)
        assert mean.metrics["vf_loss:sum"] == pytest.approx(np.mean(per_datum), rel=1e-5)
        with pytest.raises(errors.LossConfigError, match="'kl_coef' is a policy term"):
            native.forward_backward(data, "value", {"kl_coef": 0.1})


# ---- fsdp, 2 ranks -----------------------------------------------------------------------


FSDP_CASES = [  # (reduction, kl_coef, entropy_coef): every reduction, each with a KL and/or an entropy term
    ("sum", 0.05, 0.0),
    ("token_mean", 0.0, 0.01),
    ("seq_mean_token_mean", 0.05, 0.02),
    ("seq_mean_token_sum", 0.0, 0.02),
    ("seq_mean_token_sum_norm", 0.1, 0.03),
]


def references_with_terms(data_by_kl, cases):
    """Per case, the formula of ``terms.py`` by plain autograd on the HF model (one forward, one backward
    per case): reduce(ppo) + kl_coef * reduce(m * k3) - entropy_coef * reduce(m * H).
    Returns per case {metric: value} and the gradients by parameter name."""
    model = load_model("tiny", seed=0).module
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_token = {}  # (with_kl) -> (pg, kl, entropy, masks), lists over datums
    for with_kl, data in data_by_kl.items():
        pg, kl, ent, masks = [], [], [], []
        for d in data:
            ids = torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)
            logp_all = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            inputs = {k: v.array for k, v in d.loss_fn_inputs.items()}
            lp = logp_all.gather(1, torch.from_numpy(inputs["target_tokens"]).unsqueeze(1)).squeeze(1)
            m = torch.from_numpy(inputs["weights"])
            pg.append(ppo_per_token(lp, inputs))
            x = torch.from_numpy(inputs["logprobs"] - 0.2) - lp  # ref_logprobs - lp: k3
            kl.append((torch.exp(x) - x - 1) * m)
            ent.append(-(logp_all.exp() * logp_all).sum(-1) * m)
            masks.append(inputs["weights"])
        per_token[with_kl] = pg, kl, ent, masks
    out = []
    for reduction, kl_coef, entropy_coef in cases:
        pg, kl, ent, masks = per_token[bool(kl_coef)]
        pg_loss, kl_loss, entropy = (reduce_reference(x, masks, reduction) for x in (pg, kl, ent))
        total = pg_loss + kl_coef * kl_loss - entropy_coef * entropy
        grads = torch.autograd.grad(total, [p for _, p in params], retain_graph=True, allow_unused=True)
        metrics = {"loss:sum": float(total.detach()), "total_loss:sum": float(total.detach()),
                   "pg_loss:sum": float(pg_loss.detach())}
        if kl_coef:
            metrics["kl_loss:sum"] = float(kl_loss.detach())
        if entropy_coef:
            metrics["entropy_loss:sum"] = float(sum(e.sum() for e in ent).detach())
        out.append((metrics, {n: g for (n, _), g in zip(params, grads, strict=True) if g is not None}))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_two_ranks_match_the_local_engine_and_the_formula(tmp_path):
    """Normalizers are per call, so the 2-rank split changes nothing: every reduction, with KL and entropy
    terms, on one local Backend and then one fsdp Backend (gradients zeroed between the cases)."""
    pytest.importorskip("skyrl_sdk_fsdp")
    no_kl = rl_data_with_weights([7, 12, 3, 20, 9], seed=4)
    with_kl = [types.Datum(model_input=d.model_input,
                           loss_fn_inputs={**d.loss_fn_inputs,
                                           "ref_logprobs": types.TensorData(d.loss_fn_inputs["logprobs"].array - 0.2)})
               for d in no_kl]
    data_by_kl = {False: no_kl, True: with_kl}
    configs = [config_for(r, kl_coef=kl, entropy_coef=ent) for r, kl, ent in FSDP_CASES]
    names = [f"{r} kl_coef={kl} entropy_coef={ent}" for r, kl, ent in FSDP_CASES]

    local_runs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: the same float rounding on both sides
    try:
        with skyrl_sdk.Backend(seed=0, engine_config={"micro_batch_tokens": 1}) as local:
            local.save_state(tmp_path / "init")
            for (_, kl, _), cfg in zip(FSDP_CASES, configs, strict=True):
                local.zero_grad()
                out = local.forward_backward(data_by_kl[bool(kl)], "ppo", cfg)
                local_runs.append((out.metrics, {n: g.numpy() for n, g in grads_of(local).items()}))
    finally:
        torch.set_num_threads(threads)

    # the local engine against the formula
    for case, (metrics, grads), (expected, f_grads) in zip(
            names, local_runs, references_with_terms(data_by_kl, FSDP_CASES), strict=True):
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=2e-5, abs=1e-6), (case, key)
        assert_tensors_close(grads, f_grads, atol=2e-5, rtol=1e-4, what=case)

    # fsdp with 2 ranks against the local engine
    with skyrl_sdk.Backend(model="tiny", engine="fsdp",
                           engine_config={"world_size": 2, "micro_batch_tokens": 1}) as fsdp:
        fsdp.load_state(tmp_path / "init")
        for (_, kl, ent), cfg, case, (metrics, grads) in zip(FSDP_CASES, configs, names, local_runs, strict=True):
            fsdp.zero_grad()
            out = fsdp.forward_backward(data_by_kl[bool(kl)], "ppo", cfg)
            keys = ["loss:sum", "total_loss:sum", "pg_loss:sum"] + ["kl_loss:sum"] * bool(kl) \
                + ["entropy_loss:sum"] * bool(ent)
            for key in keys:
                assert out.metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (case, key)
            fsdp_grads = fsdp.engine.gradients()
            assert fsdp_grads.keys() == grads.keys(), case
            for name, g in grads.items():
                np.testing.assert_allclose(np.asarray(fsdp_grads[name]), g, atol=1e-6, rtol=1e-5,
                                           err_msg=f"{case}: {name}")
