"""The fsdp engine (2 gloo ranks on CPU) gives the local engine's results.

One fsdp Backend serves the whole module (starting ranks costs seconds); every test first
loads a state saved by the *local* engine into it, which also exercises local -> fsdp
portability. Gradients are compared directly (Adam would hide a scaled gradient).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skyrl_sdk_fsdp")

from fsdp_testutil import LENGTHS, ONE_PER_MICRO_BATCH, saved_weights
from safetensors.torch import load_file

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.errors import CheckpointError, DatumError, InputError
from skyrl_sdk.testing import (
    assert_metrics_close,
    assert_outputs_close,
    assert_tensors_close,
    grads_of,
    make_rl_data,
    make_sft_data,
    torch_threads,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=50.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):  # the ranks' thread count (2 cores / 2 ranks)
        yield


@pytest.fixture(scope="module")
def fsdp():
    backend = skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2, **ONE_PER_MICRO_BATCH})
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def initial_state(tmp_path_factory):
    """The seed-0 initial weights, saved by the local engine."""
    path = tmp_path_factory.mktemp("init") / "state"
    with skyrl_sdk.Backend(model="tiny", engine_config=ONE_PER_MICRO_BATCH) as local:
        local.save_state(path)
    return path


@pytest.fixture
def pair(fsdp, initial_state):
    fsdp.load_state(initial_state)
    local = skyrl_sdk.Backend(model="tiny", engine_config=ONE_PER_MICRO_BATCH)
    yield fsdp, local
    fsdp.zero_grad()
    local.close()


def test_engine_is_a_plugin(fsdp):
    info = fsdp.get_info()
    assert info.engine == "fsdp"
    assert fsdp.engine.world_size == 2
    assert len(fsdp.engine.rank_pids) == 2
    local = skyrl_sdk.Backend(model="tiny")
    assert info.num_parameters == local.get_info().num_parameters
    local.close()


CASES = {
    "cross_entropy": (None, lambda: make_sft_data(LENGTHS, seed=1)),
    "ppo": ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, lambda: make_rl_data(LENGTHS, seed=2)),
    "reinforce": (None, lambda: make_rl_data(LENGTHS, seed=3, with_logprobs=False)),
}


@pytest.mark.parametrize("loss_fn", sorted(CASES))
def test_matches_local_engine_over_adamw_steps(pair, loss_fn, tmp_path):
    if loss_fn == "reinforce":
        pytest.importorskip("skyrl_sdk_reinforce")
    fsdp, local = pair
    config, make = CASES[loss_fn]
    data = make()
    for step in range(3):
        out_f = fsdp.forward_backward(data, loss_fn, config)
        out_l = local.forward_backward(data, loss_fn, config)
        assert_metrics_close(out_f.metrics, out_l.metrics)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        # identical weights before the first step: gradients agree to float32 reduction noise
        tol = 1e-6 if step == 0 else 1e-5
        assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=tol, rtol=tol, what=f"grad@{step}")
        m_f = fsdp.optim_step(ADAM).metrics
        m_l = local.optim_step(ADAM).metrics
        assert m_f["grad_norm"] == pytest.approx(m_l["grad_norm"], rel=1e-5)
        assert m_f["grad_norm_clipped"] == pytest.approx(m_l["grad_norm_clipped"], rel=1e-5)
        assert m_f["step"] == m_l["step"] == step + 1
    assert_tensors_close(saved_weights(fsdp, tmp_path / "f"), saved_weights(local, tmp_path / "l"), atol=5e-5,
                        what="weights")


def test_gradient_is_a_sum_over_datums_and_calls(pair):
    """SUM semantics: two calls add up, whatever the split across ranks (no mean reduction)."""
    fsdp, local = pair
    data = make_sft_data(LENGTHS, seed=4)
    fsdp.forward_backward(data[:2])
    fsdp.forward_backward(data[2:])
    local.forward_backward(data)
    assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-6, rtol=1e-6, what="grad")


def test_an_overflowing_step_is_rolled_back_on_every_rank(pair, tmp_path):
    """lr=3e38 passes AdamParams' checks but would overflow the weights: both engines undo it."""
    fsdp, local = pair
    data = make_sft_data(LENGTHS, seed=8)
    for backend in (fsdp, local):
        backend.forward_backward(data)
        backend.optim_step(ADAM)
        before = saved_weights(backend, tmp_path / f"{backend.engine_name}-before")
        backend.forward_backward(data)
        out = backend.optim_step(types.AdamParams(learning_rate=3e38))
        assert (out.metrics["skipped"], out.metrics["nonfinite_update"], out.metrics["step"]) == (1.0, 1.0, 1.0)
        after = saved_weights(backend, tmp_path / f"{backend.engine_name}-after")
        assert_tensors_close(after, before, atol=0.0, what=backend.engine_name)


@pytest.mark.parametrize("lengths", [[11], [5, 30, 4]], ids=["one_datum", "three_datums"])
def test_fewer_or_odd_datums(pair, lengths):
    """A rank with no datum (or fewer micro-batches) still joins every collective."""
    fsdp, local = pair
    data = make_sft_data(lengths, seed=5)
    out_f, out_l = fsdp.forward_backward(data), local.forward_backward(data)
    assert_outputs_close(out_f, out_l, atol=1e-5)
    assert_metrics_close(out_f.metrics, out_l.metrics)
    assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-6, rtol=1e-6, what="grad")
    fwd_f, fwd_l = fsdp.forward(data), local.forward(data)
    assert_outputs_close(fwd_f, fwd_l, atol=1e-5)


def test_fsdp_state_loads_into_local_engine(pair, tmp_path):
    fsdp, local = pair
    data = make_rl_data(LENGTHS, seed=6)
    fsdp.forward_backward(data, "ppo")
    fsdp.optim_step(ADAM)
    fsdp.save_state(tmp_path / "fsdp_state")
    meta = (tmp_path / "fsdp_state" / "skyrl_state.json").read_text()
    assert '"state_format": "full"' in meta
    local.load_state(tmp_path / "fsdp_state")
    assert_outputs_close(fsdp.forward(data, "ppo"), local.forward(data, "ppo"), atol=1e-6)
    # the optimizer state came along: one more step stays in lockstep
    fsdp.forward_backward(data, "ppo")
    local.forward_backward(data, "ppo")
    assert fsdp.optim_step(ADAM).metrics["step"] == local.optim_step(ADAM).metrics["step"] == 2
    assert_tensors_close(saved_weights(fsdp, tmp_path / "f"), saved_weights(local, tmp_path / "l"), atol=5e-5,
                        what="weights")


def test_local_state_loads_into_fsdp_engine(pair, tmp_path):
    fsdp, local = pair
    data = make_sft_data(LENGTHS, seed=7)
    local.forward_backward(data)
    local.optim_step(ADAM)
    local.save_state(tmp_path / "local_state")
    fsdp.load_state(tmp_path / "local_state")
    assert_outputs_close(fsdp.forward(data), local.forward(data), atol=1e-6)
    saved = load_file(str(tmp_path / "local_state" / "optimizer.safetensors"))
    fsdp.save_state(tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "optimizer.safetensors"))
    assert_tensors_close({k: v.numpy() for k, v in again.items()}, {k: v.numpy() for k, v in saved.items()},
                        atol=0, what="optimizer round trip")
    fsdp.forward_backward(data)
    local.forward_backward(data)
    fsdp.optim_step(ADAM)
    local.optim_step(ADAM)
    assert_tensors_close(saved_weights(fsdp, tmp_path / "f"), saved_weights(local, tmp_path / "l"), atol=5e-5,
                        what="weights")


def test_load_state_without_optimizer(pair, tmp_path):
    fsdp, local = pair
    data = make_sft_data(LENGTHS, seed=8)
    local.forward_backward(data)
    local.optim_step(ADAM)
    local.save_state(tmp_path / "s")
    fsdp.load_state(tmp_path / "s", optimizer=False)
    fsdp.forward_backward(data)
    assert fsdp.optim_step(ADAM).metrics["step"] == 1


def test_save_weights_for_sampler_matches_local(pair, tmp_path):
    fsdp, local = pair
    fsdp.save_weights_for_sampler(tmp_path / "f")
    local.save_weights_for_sampler(tmp_path / "l")
    names = sorted(p.name for p in (tmp_path / "l").iterdir())
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == names
    a = load_file(str(tmp_path / "f" / "model.safetensors"))
    b = load_file(str(tmp_path / "l" / "model.safetensors"))
    assert_tensors_close({k: v.numpy() for k, v in a.items()}, {k: v.numpy() for k, v in b.items()}, atol=0,
                        what="export")
    assert (tmp_path / "f" / "config.json").read_text() == (tmp_path / "l" / "config.json").read_text()


def test_sample_matches_local(pair):
    fsdp, local = pair
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[1, 2, 3], [40, 41]]
    got = fsdp.sample(prompts, params, num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2)
    want = local.sample(prompts, params, num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=2)
    for g, w in zip(got, want, strict=True):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        np.testing.assert_allclose(g.sequences[0].logprobs, w.sequences[0].logprobs, atol=1e-5)
        np.testing.assert_allclose(g.prompt_logprobs[1:], w.prompt_logprobs[1:], atol=1e-5)
        assert [[t for t, _ in pos] for pos in g.topk_prompt_logprobs[1:]] == \
            [[t for t, _ in pos] for pos in w.topk_prompt_logprobs[1:]]
    # the rank-0 sampler copy follows the weights
    data = make_sft_data(LENGTHS, seed=9)
    for b in (fsdp, local):
        b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=0.05))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    got = fsdp.sample(prompts, params, num_samples=1)
    want = local.sample(prompts, params, num_samples=1)
    assert [s.sequences[0].tokens for s in got] == [s.sequences[0].tokens for s in want]


def test_bad_input_is_rejected_before_dispatch(pair, tmp_path):
    fsdp, local = pair
    bad = make_sft_data([4], seed=10)
    bad[0] = types.Datum(model_input=bad[0].model_input, loss_fn_inputs={"target_tokens": [1, 2, 3, 10**6]})
    with pytest.raises(DatumError):
        fsdp.forward_backward(bad)
    with pytest.raises(InputError):
        fsdp.forward_backward(make_sft_data([4]), loss_fn="no_such_loss")
    # a checkpoint of another shape is refused by the controller; the engine stays usable
    local.save_state(tmp_path / "s")
    from safetensors.torch import save_file

    weights = load_file(str(tmp_path / "s" / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1]
    save_file(weights, str(tmp_path / "s" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shape"):
        fsdp.load_state(tmp_path / "s")
    data = make_sft_data(LENGTHS, seed=11)
    assert_outputs_close(fsdp.forward(data), local.forward(data), atol=1e-5)


def _state_files(backend, path):
    backend.save_state(path)
    return {f: load_file(str(path / f)) for f in ("model.safetensors", "optimizer.safetensors")}


def test_corrupt_checkpoints_are_refused_by_the_controller_and_change_nothing(pair, tmp_path):
    import shutil

    import torch
    from safetensors.torch import save_file

    fsdp, local = pair
    fsdp.forward_backward(make_sft_data(LENGTHS, seed=12))
    fsdp.optim_step(ADAM)
    fsdp.save_state(tmp_path / "good")
    fsdp.forward_backward(make_sft_data([4, 6], seed=13))  # pending gradients must survive too
    before = _state_files(fsdp, tmp_path / "before")
    grads_before = fsdp.engine.gradients()

    def zero_moments(t):
        t.update({k: torch.zeros(1) for k in t if k.endswith(("::exp_avg", "::exp_avg_sq"))})

    def nan_head(t):
        t["lm_head.weight"] = t["lm_head.weight"].clone()
        t["lm_head.weight"][0, 0] = float("nan")

    cases = [
        ("optimizer.safetensors", zero_moments, r"exp_avg: shape \[1\]"),
        ("optimizer.safetensors", lambda t: t.update({"lm_head.weight::exp_avg": torch.zeros(3, 3)}), r"\[3, 3\]"),
        ("optimizer.safetensors", lambda t: t.pop("lm_head.weight::step"), "lm_head.weight::step: missing"),
        ("model.safetensors", nan_head, "non-finite"),
        ("model.safetensors", lambda t: t.update({"lm_head.weight": t["lm_head.weight"].long()}), "dtype int64"),
    ]
    for i, (file, change, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(tmp_path / "good", bad)
        tensors = load_file(str(bad / file))
        change(tensors)
        save_file(tensors, str(bad / file))
        with pytest.raises(CheckpointError, match=message):
            fsdp.load_state(bad)
    after = _state_files(fsdp, tmp_path / "after")
    for file in before:
        assert before[file].keys() == after[file].keys()
        assert all(torch.equal(before[file][k], after[file][k]) for k in before[file]), file
    grads_after = fsdp.engine.gradients()
    assert all(np.array_equal(grads_before[k], grads_after[k]) for k in grads_before)


def test_engine_config_is_validated_before_any_process_starts():
    with pytest.raises(InputError, match="unknown key"):
        skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2, "nope": 1})
    with pytest.raises(InputError, match="launcher"):
        skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"launcher": "mpi"})
