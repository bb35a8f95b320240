"""RL losses through the Backend: invariance to micro-batching (incl. whole-call statistics)."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk.engines.throughput import without_throughput
from skyrl_sdk.testing import assert_tensors_close, count_micro_batches, grads_of, make_rl_data


@pytest.mark.parametrize("loss_fn,config,dialect", [
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "tinker"),
    ("gspo", None, "tinker"),
    ("cispo", None, "tinker"),
    ("dro", {"beta": 0.5}, "tinker"),
    ("clip_cov", {"clip_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}, "native"),
    ("kl_cov", {"kl_cov_ratio": 0.2}, "native"),
])
def test_rl_loss_gradients_do_not_depend_on_micro_batching(loss_fn, config, dialect):
    data = make_rl_data([9, 14, 5, 21, 11], seed=2)
    with skyrl_sdk.Backend(seed=0, dialect=dialect, engine_config={"micro_batch_tokens": 100000}) as whole, \
            skyrl_sdk.Backend(seed=0, dialect=dialect, engine_config={"micro_batch_tokens": 22, "batching": "pack"}) as split:
        with count_micro_batches() as boundaries:
            a = whole.forward_backward(data, loss_fn, config)
        assert boundaries == [0]
        with count_micro_batches() as boundaries:
            b = split.forward_backward(data, loss_fn, config)
        assert boundaries[0] >= 2  # 60 tokens in micro-batches of at most 22: at least 3
        assert a.metrics.keys() == b.metrics.keys()
        for key in without_throughput(a.metrics):
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-5), key
        assert a.metrics["loss:sum"] != 0.0
        assert_tensors_close(grads_of(split), grads_of(whole), atol=2e-5, rtol=1e-4)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=2e-5)


def test_tinker_ppo_equals_native_regular_with_offsets():
    data = make_rl_data([9, 14, 5], seed=3)
    with skyrl_sdk.Backend(seed=0) as tinker, skyrl_sdk.Backend(seed=0, dialect="native") as native:
        a = tinker.forward_backward(data, "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.25})
        b = native.forward_backward(data, "regular", {"eps_clip_low": 0.3, "eps_clip_high": 0.25})
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
        assert_tensors_close(grads_of(tinker), grads_of(native), atol=1e-7)


def test_rl_metrics_are_reported():
    data = make_rl_data([9, 14], seed=4)
    with skyrl_sdk.Backend(seed=0) as backend:
        out = backend.forward_backward(data, "ppo")
    for key in ("loss:sum", "total_loss:sum", "pg_loss:sum", "entropy_loss:sum", "num_tokens:sum",
                "clip_fraction:mean", "kl_sample_train:mean"):
        assert key in out.metrics, key
    assert out.metrics["num_tokens:sum"] == 23
    assert all(k.count(":") == 1 for k in out.metrics)


@pytest.mark.parametrize("low, high, match", [
    (1.2, 1.5, "clip_low_threshold.*0 <= value <= 1.*got 1.2"),
    (0.8, 0.9, "clip_high_threshold.*value >= 1.*got 0.9"),
])
def test_per_token_clip_bounds_are_validated(low, high, match):
    from skyrl_sdk import errors, types

    data = make_rl_data([6, 4], seed=5)
    d = data[1]
    n = d.model_input.length
    low_t = np.full(n, 0.8, np.float32)
    high_t = np.full(n, 1.2, np.float32)
    low_t[2], high_t[2] = low, high
    bad = types.Datum(model_input=d.model_input, loss_fn_inputs={
        **{k: v.array for k, v in d.loss_fn_inputs.items()},
        "clip_low_threshold": low_t, "clip_high_threshold": high_t})
    good = types.Datum(model_input=data[0].model_input, loss_fn_inputs={
        **{k: v.array for k, v in data[0].loss_fn_inputs.items()},
        "clip_low_threshold": np.full(6, 0.8, np.float32), "clip_high_threshold": np.full(6, 1.2, np.float32)})
    with skyrl_sdk.Backend(seed=0) as backend:
        with pytest.raises(errors.DatumError, match="datum 1.*" + match):
            backend.forward_backward([good, bad], "ppo")
        assert grads_of(backend) == {}
        backend.forward_backward([good], "ppo")  # valid per-token bounds are accepted
