"""Property-based fuzzing of everything a caller can hand the Backend (issue 9).

Every generated input is either accepted and gives a correct-looking result, or rejected
with ``ValueError``/``TypeError`` (our ``InputError`` is a ``ValueError``) while the
backend stays bit-identical. The default profile is short (CI); ``HYPOTHESIS_PROFILE=long``
runs the long one (``-m fuzz`` selects just these tests).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import skyrl_sdk
from _probes import Probes
from skyrl_sdk import types
from skyrl_sdk.inputs import tinker_json as serde
from skyrl_sdk.inputs.coerce import adam_params_from_any, sampling_params_from_any
from skyrl_sdk.testing import make_sft_data, weights_of

pytestmark = pytest.mark.fuzz

VOCAB = 320  # the tiny model's
#: probes tried / handled (accepted or rejected), by group; $SKYRL_PROBE_REPORT (closing notes)
PROBES = Probes("fuzz: hostile inputs")
_probe_report = PROBES.report_fixture()


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        yield b


def _snapshot(backend):
    runner = backend.engine.runner
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in runner.named_trainable()}
    return weights_of(backend), grads, runner.optimizer.step_count


def _assert_same(before, backend):
    weights, grads, step = before
    now_w, now_g, now_step = _snapshot(backend)
    assert step == now_step
    for k in weights:
        assert torch.equal(weights[k], now_w[k]), k
        assert (grads[k] is None) == (now_g[k] is None), k
        if grads[k] is not None:
            assert torch.equal(grads[k], now_g[k]), k


# ---- strategies -----------------------------------------------------------------------------
numbers = st.one_of(
    st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.just(None), st.text(max_size=3),
)
token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, 5), st.integers(VOCAB - 2, VOCAB + 2),
                  st.integers(2**62, 2**64), st.floats(allow_nan=True), st.just("7"))
flat_tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
token_lists = st.one_of(flat_tokens, st.lists(token, max_size=8), st.lists(st.lists(token, max_size=3), max_size=3),
                        st.text(max_size=4), st.just({}), st.just(None))


@st.composite
def sparse_tensor(draw):
    rows, cols = draw(st.integers(-1, 5)), draw(st.integers(-1, 5))
    nnz = draw(st.integers(0, 6))
    return {
        "data": draw(st.lists(st.floats(-3, 3), min_size=nnz, max_size=nnz)),
        "dtype": draw(st.sampled_from(["float32", "int64", "bfloat16"])),
        "shape": [rows, cols] if draw(st.booleans()) else draw(st.lists(st.integers(-2, 6), max_size=3)),
        "sparse_crow_indices": draw(st.lists(st.integers(-1, nnz + 1), max_size=7)),
        "sparse_col_indices": draw(st.lists(st.integers(-1, 6), min_size=nnz, max_size=nnz)),
    }


def tensor_for(n: int):
    values = st.lists(st.one_of(st.floats(-4, 4), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 400)),
                      min_size=max(0, n - 1), max_size=n + 1)
    dense_json = st.builds(lambda d, shape: {"data": d, "dtype": "float32", **({"shape": shape} if shape else {})},
                           values, st.one_of(st.none(), st.lists(st.integers(-1, 13), max_size=2)))
    return st.one_of(values, dense_json, sparse_tensor(), st.just("x"), st.just(None), st.just({"shape": [2]}))


@st.composite
def valid_datum(draw):
    tokens = draw(flat_tokens)
    n = len(tokens)
    floats = st.lists(st.floats(-3, 3, width=32), min_size=n, max_size=n)
    inputs = {"target_tokens": draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
              "logprobs": draw(st.lists(st.floats(-8, 0, width=32), min_size=n, max_size=n)),
              "advantages": draw(floats)}
    if draw(st.booleans()):
        inputs["weights"] = draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=n, max_size=n))
    return ("datum", tokens, inputs)


@st.composite
def hostile_datum(draw):
    tokens = draw(token_lists)
    n = len(tokens) if isinstance(tokens, list) else 3
    keys = draw(st.lists(st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", "bogus", ""]),
                         max_size=4, unique=True))
    inputs = {}
    for key in keys:
        if key == "target_tokens" and draw(st.booleans()):
            inputs[key] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        else:
            inputs[key] = draw(tensor_for(n))
    form = draw(st.sampled_from(["json", "datum"]))
    if form == "json":
        return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "loss_fn_inputs": inputs}
    return ("datum", tokens, inputs)


def _materialize(obj):
    if isinstance(obj, tuple):
        _, tokens, inputs = obj
        return types.Datum(model_input=tokens, loss_fn_inputs=inputs)
    return obj


# ---- properties -----------------------------------------------------------------------------
@given(obj=tensor_for(4))
def test_tensor_json_is_parsed_or_refused(obj):
    group = "TensorData (dense and sparse JSON)"
    PROBES.tried(group)
    try:
        t = serde.tensor_from_json(obj, "float32")
    except (ValueError, TypeError):
        PROBES.handled(group, "rejected")
        return
    assert t.dtype in ("float32", "int64") and t.array.dtype in (np.float32, np.int64)
    PROBES.handled(group, "accepted")


@given(raw=st.one_of(valid_datum(), hostile_datum()), loss=st.sampled_from(["cross_entropy", "importance_sampling", "ppo"]))
def test_forward_backward_accepts_or_refuses_without_a_trace(backend, raw, loss):
    group = "Datum / ModelInput through forward_backward"
    PROBES.tried(group)
    before = _snapshot(backend)
    try:
        datum = _materialize(raw)
        out = backend.forward_backward([datum], loss)
    except (ValueError, TypeError):
        _assert_same(before, backend)
        PROBES.handled(group, "rejected")
        return
    n = datum.model_input.length if isinstance(datum, types.Datum) else len(raw["model_input"]["chunks"][0]["tokens"])
    assert out.loss_fn_outputs[0]["logprobs"].shape == (n,)
    assert all(math.isfinite(v) for v in out.metrics.values())
    backend.zero_grad()
    PROBES.handled(group, "accepted")


@given(name=st.sampled_from(["ppo", "cispo", "dro", "gspo", "importance_sampling", "regular", "dual_clip", "sapo",
                             "clip_cov", "kl_cov", "cross_entropy"]),
       config=st.dictionaries(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "eps_clip_low",
                                               "eps_clip_high", "clip_ratio_c", "tau_pos", "tau_neg", "bogus"]),
                              numbers, max_size=3))
def test_loss_configs_are_validated(backend, name, config):
    PROBES.tried("loss configs")
    try:
        resolved = backend.resolve(name, config)
    except (ValueError, TypeError):
        PROBES.handled("loss configs", "rejected")
        return
    if resolved.config is not None:
        import attrs

        for value in attrs.asdict(resolved.config).values():
            if isinstance(value, float):
                assert math.isfinite(value)
    PROBES.handled("loss configs", "accepted")


sane_adam = st.fixed_dictionaries({"learning_rate": st.floats(0, 1e38)}, optional={
    "beta1": st.floats(0, 0.999), "beta2": st.floats(0, 0.999), "eps": st.floats(1e-38, 1.0),
    "weight_decay": st.floats(0, 10.0), "grad_clip_norm": st.floats(0, 10.0),
})
hostile_adam = st.fixed_dictionaries({}, optional={
    "learning_rate": st.one_of(numbers, st.floats(0, 1e38)), "beta1": numbers, "beta2": numbers,
    "eps": st.one_of(numbers, st.floats(0, 1e-30)), "weight_decay": st.one_of(numbers, st.floats(0, 1e31)),
    "grad_clip_norm": numbers, "lr": numbers,
})


@given(fields=st.one_of(sane_adam, hostile_adam))
def test_adam_params_never_make_weights_non_finite(fields):
    PROBES.tried("AdamParams")
    try:
        params = adam_params_from_any(fields)
    except (ValueError, TypeError):
        PROBES.handled("AdamParams", "rejected")
        return
    with skyrl_sdk.Backend(model="tiny", seed=0) as b:
        b.forward_backward(make_sft_data([5, 7], seed=1))
        b.optim_step(params)
        assert all(torch.isfinite(w).all() for w in weights_of(b).values())
    PROBES.handled("AdamParams", "accepted")


sane_sampling = st.fixed_dictionaries({"max_tokens": st.integers(1, 3)}, optional={
    "temperature": st.floats(0, 2), "top_k": st.integers(1, 50), "top_p": st.floats(0.01, 1.0),
    "seed": st.integers(0, 2**31), "stop": st.lists(st.one_of(st.text(min_size=1, max_size=2), st.integers(0, 319)),
                                                     max_size=2),
})
hostile_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(numbers, st.integers(1, 3)), "temperature": numbers, "top_k": numbers, "top_p": numbers,
    "seed": numbers, "stop": st.one_of(numbers, st.lists(st.one_of(st.text(max_size=2), st.integers(-2, 400)),
                                                         max_size=2)),
})


@given(fields=st.one_of(sane_sampling, hostile_sampling), prompt=st.one_of(flat_tokens, token_lists))
def test_sampling_params_and_prompts_are_validated(backend, fields, prompt):
    group = "SamplingParams and prompts"
    PROBES.tried(group)
    try:
        params = sampling_params_from_any(fields)
        if params.max_tokens > 3:
            params = types.SamplingParams(**{**fields, "max_tokens": 3})
        out = backend.sample([prompt], params)
    except (ValueError, TypeError):
        PROBES.handled(group, "rejected")
        return
    seq = out[0].sequences[0]
    assert 1 <= len(seq.tokens) <= 3 and all(0 <= t < VOCAB for t in seq.tokens)
    assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 or math.isnan(lp) is False for lp in seq.logprobs)
    PROBES.handled(group, "accepted")


# ---- checkpoint files ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_state(tmp_path_factory, backend):
    """A valid state of the module's backend (one step taken), saved once."""
    backend.forward_backward(make_sft_data([5, 8], seed=9))
    backend.optim_step(types.AdamParams(learning_rate=1e-3))
    path = tmp_path_factory.mktemp("fuzz-state") / "state"
    backend.save_state(path)
    return path


FILES = ("model.safetensors", "optimizer.safetensors")
tensor_change = st.one_of(
    st.just(("drop", None)), st.just(("add", None)), st.just(("reshape", None)), st.just(("dtype", None)),
    st.sampled_from([("value", float("nan")), ("value", float("inf")), ("value", -1.0), ("value", 0.5),
                     ("value", 1e30)]),
)
json_change = st.one_of(
    st.just(("json", "list")), st.just(("json", "step")), st.just(("json", "identity")), st.just(("json", "garbage")),
    st.tuples(st.just("json_value"), st.sampled_from(["format", "engine", "identity", "engine_state"]), numbers),
)


@given(file=st.sampled_from(FILES), change=tensor_change, which=st.integers(0, 10_000), other=json_change,
       use_json=st.booleans())
@pytest.mark.slow
def test_corrupt_checkpoints_are_refused_without_a_trace(backend, saved_state, tmp_path_factory, file, change, which,
                                                         other, use_json):
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("fuzz") / "state"
    shutil.copytree(saved_state, target)
    if use_json:
        meta_path = target / "skyrl_state.json"
        meta = json.loads(meta_path.read_text())
        kind = other[0]
        if kind == "json":
            meta = {"list": [meta], "step": {**meta, "engine_state": {**meta.get("engine_state", {}), "step": "x"}},
                    "identity": {**meta, "identity": 7}, "garbage": None}[other[1]]
            meta_path.write_text(json.dumps(meta) if meta is not None else "{not json")
        else:
            meta[other[1]] = other[2]
            meta_path.write_text(json.dumps(meta, default=str))
    else:
        tensors = load_file(str(target / file))
        keys = sorted(tensors)
        key = keys[which % len(keys)]
        kind, value = change
        if kind == "drop":
            del tensors[key]
        elif kind == "add":
            tensors["bogus.weight"] = torch.zeros(2)
        elif kind == "reshape":
            tensors[key] = tensors[key].reshape(-1)[:1].clone() if tensors[key].numel() > 1 else torch.zeros(2, 2)
        elif kind == "dtype":
            tensors[key] = tensors[key].to(torch.float64 if tensors[key].dtype != torch.float64 else torch.int64)
        else:
            t = tensors[key].clone()
            t.view(-1)[0] = value
            tensors[key] = t
        save_file(tensors, str(target / file))
    PROBES.tried("checkpoint files")
    before = _snapshot(backend)
    try:
        backend.load_state(target)
    except (ValueError, TypeError):
        _assert_same(before, backend)
        PROBES.handled("checkpoint files", "rejected")
        return
    # accepted: every loaded weight is finite and the model still trains
    assert all(torch.isfinite(w).all() for w in weights_of(backend).values())
    backend.load_state(saved_state)
    PROBES.handled("checkpoint files", "accepted")
