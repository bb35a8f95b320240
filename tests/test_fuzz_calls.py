"""Property: any sequence of valid and invalid calls leaves a Backend exactly where the valid
calls alone put it (issue 21: every call all or nothing).

Backend ``a`` gets every call; backend ``b`` only the valid ones. Invalid calls are refused
before compute (bad data, configs, AdamParams, corrupt checkpoints) or fail mid-call (a plugin
loss that raises after earlier micro-batches back-propagated, an out-of-memory error in
backward). After the sequence both hold bit-identical weights, pending gradients, AdamW state,
step and call counts, and one more optim_step keeps them identical (``grad_accumulation="mean"``
divides by the call count, so a miscounted failure shows). Short profile by default;
``HYPOTHESIS_PROFILE=long`` for the long run (tests/conftest.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import _fragile
import skyrl_sdk
from _probes import Probes
from skyrl_sdk import types
from skyrl_sdk.testing import assert_tensors_close, grads_of, make_rl_data, make_sft_data, weights_of

pytestmark = pytest.mark.fuzz

#: a few tokens per micro-batch: a call of several datums runs several backward passes
ENGINE = {"micro_batch_tokens": 8}
#: calls tried / handled (each kind's outcome checked), by kind; $SKYRL_PROBE_REPORT
PROBES = Probes("fuzz: call sequences")
_probe_report = PROBES.report_fixture()


@pytest.fixture(scope="module")
def fragile():
    """The failing losses of tests/_fragile.py, declared for this module only."""
    from skyrl_sdk import hooks
    from skyrl_sdk.plugins import manager

    declared = list(hooks.DECLARED)
    _fragile.declare([])
    yield
    hooks.DECLARED[:] = declared
    manager.reset()


@pytest.fixture(scope="module")
def pair(fragile, tmp_path_factory):
    """``(a, b, start)``: two equal Backends and their saved starting state."""
    options = dict(model="tiny", seed=0, grad_accumulation="mean", engine_config=ENGINE)
    with skyrl_sdk.Backend(**options) as a, skyrl_sdk.Backend(**options) as b:
        start = tmp_path_factory.mktemp("fuzz-calls") / "start"
        a.save_state(start)
        yield a, b, start


# ---- calls ------------------------------------------------------------------------------------------
lengths = st.lists(st.integers(2, 7), min_size=1, max_size=3)
good_fb = st.tuples(st.just("forward_backward"), lengths, st.integers(0, 99),
                    st.sampled_from(["cross_entropy", "ppo", "fragile_ce"]))
bad_fb = st.tuples(st.just("bad forward_backward"), st.sampled_from([
    "bool targets", "out of vocabulary", "beyond the positions", "nan advantages", "differing keys", "no data",
    "clip_high_threshold 1e308", "sapo tau_neg 1e300", "reduction the loss cannot serve",
    "raises mid-call", "out of memory in backward",
]), st.integers(0, 99))
forward = st.tuples(st.just("forward"), st.booleans(), st.integers(0, 99))
good_step = st.tuples(st.just("optim_step"), st.sampled_from([1e-3, 1e-2]), st.sampled_from([0.0, 0.5]))
bad_step = st.tuples(st.just("bad optim_step"), st.sampled_from([
    {"learning_rate": -1.0}, {"beta1": 1.5}, {"eps": 0.0}, {"lr": 1e-3}, {"learning_rate": float("nan")},
]))
checkpoints = st.one_of(st.tuples(st.just("save")), st.tuples(st.just("load"), st.integers(0, 5)),
                        st.tuples(st.just("load corrupt"), st.sampled_from(["truncated weights", "garbage json",
                                                                            "no optimizer file", "wrong shape"])))
#: how often each kind of call comes (the forward_backward calls are what the property is about)
WEIGHTED = [good_fb] * 4 + [bad_fb] * 4 + [forward, good_step, good_step, bad_step, st.tuples(st.just("zero_grad")),
                                           checkpoints]
calls = st.lists(st.integers(0, len(WEIGHTED) - 1).flatmap(lambda i: WEIGHTED[i]), min_size=2, max_size=10)


def _bad_call(kind: str, seed: int):
    """``(data, loss_fn, loss_fn_config)`` of an invalid forward_backward of ``kind``."""
    sft, rl = make_sft_data([3, 5, 4], seed=seed), make_rl_data([4, 6], seed=seed)

    def json_datum(targets, tokens=(1, 2, 3)):
        return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
                "loss_fn_inputs": {"target_tokens": targets}}

    if kind == "nan advantages":
        adv = rl[0].loss_fn_inputs["advantages"].array.copy()
        adv[1] = np.nan
        rl[0] = types.Datum(model_input=rl[0].model_input, loss_fn_inputs={**rl[0].loss_fn_inputs, "advantages": adv})
    return {
        "bool targets": ([json_datum([True, False, True])], "cross_entropy", None),
        "out of vocabulary": ([*sft, json_datum([1, 320, 2])], "cross_entropy", None),
        "beyond the positions": ([json_datum([1] * 2049, [2] * 2049)], "cross_entropy", None),
        "nan advantages": (rl, "ppo", None),
        "differing keys": ([*sft, json_datum([1, 2, 3])], "cross_entropy", None),
        "no data": ([], "cross_entropy", None),
        "clip_high_threshold 1e308": (rl, "ppo", {"clip_high_threshold": 1e308}),
        "sapo tau_neg 1e300": (rl, "sapo", {"tau_neg": 1e300}),
        "reduction the loss cannot serve": (sft, "sum_only_ce", {"loss_reduction": "seq_mean_token_mean"}),
        "raises mid-call": (_fragile.marked(sft), "fragile_ce", None),
        "out of memory in backward": (_fragile.marked(sft), "oom_ce", None),
    }[kind]


def _corrupt(source: Path, target: Path, kind: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if kind == "truncated weights":
        data = (target / "model.safetensors").read_bytes()
        (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "garbage json":
        (target / "skyrl_state.json").write_text("{not json")
    elif kind == "no optimizer file":
        (target / "optimizer.safetensors").unlink()
    else:
        tensors = load_file(str(target / "model.safetensors"))
        key = sorted(tensors)[0]
        tensors[key] = torch.zeros(3, 2)
        save_file(tensors, str(target / "model.safetensors"))
    return target


def _state(backend):
    runner = backend.engine.runner
    return (weights_of(backend), grads_of(backend), dict(runner.optimizer.state_items()), runner.optimizer.step_count,
            backend.pending_calls)


def _assert_same(a, b) -> None:
    (wa, ga, oa, sa, ca), (wb, gb, ob, sb, cb) = _state(a), _state(b)
    assert (sa, ca) == (sb, cb), "step and calls since the step"
    assert_tensors_close(wa, wb, atol=0.0, what="weights")
    assert_tensors_close(ga, gb, atol=0.0, what="pending gradients")
    assert_tensors_close(oa, ob, atol=0.0, what="AdamW state")


def _apply(call, a, b, saved: list[tuple[Path, Path]], scratch: Path) -> None:
    """Run ``call`` on ``a`` and, when valid, on ``b``; check the invalid one is refused."""
    kind = call[0]
    PROBES.tried(kind)
    if kind == "forward_backward":
        _, sizes, seed, loss = call
        data = make_rl_data(sizes, seed=seed) if loss == "ppo" else make_sft_data(sizes, seed=seed)
        for backend in (a, b):
            backend.forward_backward(data, loss)
    elif kind == "bad forward_backward":
        data, loss, config = _bad_call(call[1], call[2])
        with pytest.raises((ValueError, TypeError, _fragile.Boom, torch.OutOfMemoryError)):
            a.forward_backward(data, loss, config)
    elif kind == "forward":  # changes nothing, valid or not
        _, valid, seed = call
        data, loss, config = (make_sft_data([4, 3], seed=seed), "cross_entropy", None) if valid \
            else _bad_call("bool targets", seed)
        if valid:
            a.forward(data, loss, config)
        else:
            with pytest.raises(ValueError):
                a.forward(data, loss, config)
    elif kind == "optim_step":
        params = types.AdamParams(learning_rate=call[1], grad_clip_norm=call[2])
        assert a.optim_step(params).metrics == b.optim_step(params).metrics
    elif kind == "bad optim_step":
        with pytest.raises(ValueError):
            a.optim_step(call[1])
    elif kind == "zero_grad":
        a.zero_grad()
        b.zero_grad()
    elif kind == "save":
        saved.append((scratch / f"a{len(saved)}", scratch / f"b{len(saved)}"))
        a.save_state(saved[-1][0])
        b.save_state(saved[-1][1])
    elif kind == "load":
        if saved:
            path_a, path_b = saved[call[1] % len(saved)]
            a.load_state(path_a)
            b.load_state(path_b)
    else:  # load corrupt
        source = saved[-1][0] if saved else scratch.parent / "start"
        with pytest.raises(ValueError):
            a.load_state(_corrupt(source, scratch / f"corrupt{len(list(scratch.iterdir()))}", call[1]))
    PROBES.handled(kind, call[1] if kind in ("bad forward_backward", "load corrupt") else None)


@given(sequence=calls)
def test_invalid_calls_leave_no_trace_in_any_sequence(pair, sequence):
    a, b, start = pair
    for backend in (a, b):
        backend.load_state(start)
    with tempfile.TemporaryDirectory(dir=start.parent) as scratch:
        saved: list[tuple[Path, Path]] = []
        for call in sequence:
            _apply(call, a, b, saved, Path(scratch))
            _assert_same(a, b)
    params = types.AdamParams(learning_rate=1e-2)
    assert a.optim_step(params).metrics == b.optim_step(params).metrics
    _assert_same(a, b)
