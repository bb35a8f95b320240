"""load_state checks every file before it changes anything (issue 9: checkpoints that crash
or half-load). Each corrupt checkpoint raises CheckpointError naming the file, the key and
the problem, and the Backend stays bit-identical: weights, AdamW state, step count,
pending gradients, and the next optimizer step."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.testing import make_sft_data

ADAM = types.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0)
HEAD = "lm_head.weight"


def _rewrite(directory, file, change):
    tensors = load_file(str(directory / file))
    change(tensors)
    save_file(tensors, str(directory / file))


def _zero_moments(t):
    for k in t:
        if k.endswith(("::exp_avg", "::exp_avg_sq")):
            t[k] = torch.zeros(1)


def _set(key, value):
    def change(t):
        t[key] = value(t[key]) if callable(value) else value
    return change


def _nan_first(x):
    x = x.clone()
    x.view(-1)[0] = float("nan")
    return x


def _meta(directory, change):
    path = directory / "skyrl_state.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(change(meta)))


def _link_file(directory):
    os.rename(directory / "optimizer.safetensors", directory.parent / "elsewhere.safetensors")
    os.symlink(directory.parent / "elsewhere.safetensors", directory / "optimizer.safetensors")


CORRUPTIONS = {
    "zeros(1) moments": (lambda d: _rewrite(d, "optimizer.safetensors", _zero_moments), r"exp_avg: shape \[1\]"),
    "(3,3) moment for lm_head": (
        lambda d: _rewrite(d, "optimizer.safetensors", _set(f"{HEAD}::exp_avg", torch.zeros(3, 3))),
        rf"optimizer.safetensors: .*{HEAD}::exp_avg: shape \[3, 3\], expected \[320, 128\]"),
    "missing step": (
        lambda d: _rewrite(d, "optimizer.safetensors", lambda t: t.pop(f"{HEAD}::step")), rf"{HEAD}::step: missing"),
    "step not a scalar": (
        lambda d: _rewrite(d, "optimizer.safetensors", _set(f"{HEAD}::step", torch.ones(2))), "floating scalar"),
    "NaN moment": (
        lambda d: _rewrite(d, "optimizer.safetensors", _set(f"{HEAD}::exp_avg_sq", _nan_first)), "non-finite"),
    "negative second moment": (
        lambda d: _rewrite(d, "optimizer.safetensors", _set(f"{HEAD}::exp_avg_sq", lambda x: -x - 1)), "negative"),
    "unknown optimizer key": (
        lambda d: _rewrite(d, "optimizer.safetensors", _set("nope::exp_avg", torch.zeros(1))), "nope::exp_avg"),
    "NaN weight": (lambda d: _rewrite(d, "model.safetensors", _set(HEAD, _nan_first)),
                   rf"model.safetensors: .*{HEAD}: holds non-finite"),
    "int weights": (lambda d: _rewrite(d, "model.safetensors", _set(HEAD, lambda x: x.to(torch.int64))),
                    rf"{HEAD}: dtype int64, expected float32"),
    "bfloat16 weights": (lambda d: _rewrite(d, "model.safetensors", _set(HEAD, lambda x: x.bfloat16())),
                         "dtype bfloat16"),
    "missing weight": (lambda d: _rewrite(d, "model.safetensors", lambda t: t.pop(HEAD)), f"{HEAD}: missing"),
    "JSON list": (lambda d: (d / "skyrl_state.json").write_text("[1, 2]"), "expected a JSON object, got list"),
    "JSON nested 100k deep": (lambda d: (d / "skyrl_state.json").write_text("[" * 100_000), "not valid JSON"),
    "engine_state a string": (lambda d: _meta(d, lambda m: {**m, "engine_state": "x"}), "engine_state"),
    "step not an integer": (
        lambda d: _meta(d, lambda m: {**m, "engine_state": {**m["engine_state"], "step": "3"}}),
        "engine_state.step"),
    "file symlink": (_link_file, "optimizer.safetensors is a symbolic link"),
    "garbage safetensors": (lambda d: (d / "model.safetensors").write_bytes(b"\x08" + b"\0" * 64), "not a readable"),
}


@pytest.fixture(scope="module")
def good_state(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "state"
    with skyrl_sdk.Backend(seed=0) as b:
        for s in range(2):
            b.forward_backward(make_sft_data([5, 9], seed=s))
            b.optim_step(ADAM)
        b.save_state(path)
    return path


def _snapshot(backend):
    runner = backend.engine.runner
    return {
        "weights": {k: v.clone() for k, v in backend.engine.loaded.module.state_dict().items()},
        "optimizer": {k: v.clone() for k, v in runner.optimizer.state_items()},
        "grads": {n: p.grad.clone() for n, p in runner.named_trainable() if p.grad is not None},
        "step": runner.optimizer.step_count,
    }


def _assert_identical(a, b):
    assert a["step"] == b["step"]
    for part in ("weights", "optimizer", "grads"):
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


def _ready(good_state):
    """A Backend with weights, AdamW moments and pending gradients: everything a load could break."""
    backend = skyrl_sdk.Backend(seed=1)
    backend.load_state(good_state)
    backend.forward_backward(make_sft_data([6, 3], seed=7))
    return backend


@pytest.fixture(scope="module")
def victim_and_twin(good_state):
    """The victim is shown every corrupt checkpoint; the twin none (one pair: Backends cost seconds)."""
    with _ready(good_state) as victim, _ready(good_state) as twin:
        yield victim, twin, _snapshot(victim)


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_and_changes_nothing(case, good_state, victim_and_twin, tmp_path):
    victim, _, initial = victim_and_twin
    corrupt, message = CORRUPTIONS[case]
    bad = tmp_path / "bad"
    shutil.copytree(good_state, bad)
    corrupt(bad)
    with pytest.raises(errors.CheckpointError, match=message):
        victim.load_state(bad, optimizer=True)
    _assert_identical(_snapshot(victim), initial)


def test_after_every_refusal_the_next_step_is_the_twins(victim_and_twin):
    victim, twin, _ = victim_and_twin
    assert victim.engine.runner.has_pending_grads()
    victim.optim_step(ADAM)  # zeros(1) moments, had they loaded, made fused AdamW write out of bounds
    twin.optim_step(ADAM)
    _assert_identical(_snapshot(victim), _snapshot(twin))


def test_directory_symlink_is_refused(good_state, tmp_path):
    os.symlink(good_state, tmp_path / "link")
    with skyrl_sdk.Backend(seed=1) as b:
        with pytest.raises(errors.CheckpointError, match="symbolic link"):
            b.load_state(tmp_path / "link")


def test_weights_only_load_ignores_a_corrupt_optimizer_file(good_state, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(good_state, bad)
    CORRUPTIONS["zeros(1) moments"][0](bad)
    with skyrl_sdk.Backend(seed=1) as b:
        b.load_state(bad, optimizer=False)
        want = load_file(str(good_state / "model.safetensors"))
        got = b.engine.loaded.module.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert b.engine.runner.optimizer.torch_optimizer is None and b.engine.runner.optimizer.step_count == 0
