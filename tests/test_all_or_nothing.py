"""Every call is all or nothing (issue 21): what is knowable is checked before any compute, a
call that still fails mid-way leaves the pending gradients as they were, and the error says so.

Each case of the issue's table is a test here (checkpoint I/O: tests/test_checkpoint_save.py;
the stateful property: tests/test_fuzz_calls.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import _fragile
import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.evaluate import evaluate_loss
from skyrl_sdk.inputs import tinker_json
from skyrl_sdk.losses import LossOutput
from skyrl_sdk.testing import (
    assert_tensors_close,
    fresh_plugins,  # noqa: F401  (fixture)
    grads_of,
    make_rl_data,
    make_sft_data,
    weights_of,
)

ADAM = types.AdamParams(learning_rate=1e-2)
RL = make_rl_data([6, 9], seed=0)
SFT = make_sft_data([5, 7], seed=1)


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(model="tiny", seed=0, grad_accumulation="mean") as b:
        yield b


def _same(a: dict, b: dict) -> None:
    assert_tensors_close(a, b, atol=0.0, what="gradients")


def _refused_without_a_trace(backend, call, error, match) -> None:
    """``call`` raises ``error`` while a good call's gradients are pending; they stay bit for bit."""
    backend.zero_grad()
    backend.forward_backward(RL, "ppo")
    before, calls = grads_of(backend), backend.pending_calls
    with pytest.raises(error, match=match):
        call()
    _same(grads_of(backend), before)
    assert backend.pending_calls == calls


# ---- numbers in a loss config: finite and representable in the compute dtypes -------------------
@pytest.mark.parametrize("loss,config,key", [
    ("ppo", {"clip_high_threshold": 1e308}, "clip_high_threshold"),
    ("regular", {"eps_clip_high": 1e308}, "eps_clip_high"),
    ("sapo", {"tau_pos": 1e308}, "tau_pos"),
    ("sapo", {"tau_neg": 1e300}, "tau_neg"),
    ("sapo", {"tau_pos": 1e-300}, "tau_pos"),  # silently 0 in float32: a division by zero
    ("ppo", {"loss_reduction": "token_mean", "num_tokens_normalizer": 1e-300}, "num_tokens_normalizer"),
    ("clip_cov", {"seed": 2**64}, "seed"),  # torch's generator takes int64
])
def test_loss_config_numbers_beyond_the_compute_dtypes_are_refused_before_compute(backend, loss, config, key):
    for call in (backend.forward_backward, backend.forward):
        _refused_without_a_trace(backend, lambda call=call: call(RL, loss, config), errors.LossConfigError,
                                 rf"loss_fn_config\['{key}'\]: expected")
    # the first call's gradients were kept: the next step applies them
    assert backend.optim_step(ADAM).metrics["no_gradient"] == 0.0


def test_the_range_is_that_of_bfloat16_and_float32(backend):
    out = backend.forward_backward(RL, "ppo", {"clip_high_threshold": 3e38})  # within both: accepted
    assert np.isfinite(out.metrics["loss:sum"])
    backend.forward(RL, "sapo", {"tau_pos": 2e-38})  # accepted (the loss itself is huge: 1 / tau)
    backend.zero_grad()
    with pytest.raises(errors.LossConfigError, match=r"tau_pos"):
        evaluate_loss("sapo", torch.zeros(3), {"advantages": [1.0] * 3, "logprobs": [0.0] * 3}, {"tau_pos": 1e39})


# ---- sequence lengths against the model's positions -----------------------------------------------
@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A model with learned positions (64): beyond them it indexes out of its table."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from skyrl_sdk.models.loading import TINY_DIR, load_tokenizer

    config = GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=256,
                        eos_token_id=257, pad_token_id=258)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("gpt2")
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    load_tokenizer(str(TINY_DIR)).save_pretrained(str(directory))
    return directory


def test_sequences_longer_than_the_model_s_positions_are_refused_before_compute(gpt2_dir):
    with skyrl_sdk.Backend(model=str(gpt2_dir)) as b:
        assert b.engine.info.max_positions == 64
        for call in (b.forward_backward, b.forward):
            _refused_without_a_trace(b, lambda call=call: call(make_sft_data([5, 100], seed=2)), errors.DatumError,
                                     r"^datum 1: model_input has 100 tokens; this model accepts at most 64")
        b.forward(make_sft_data([64], seed=2))  # the limit itself is fine
        for prompt, max_tokens in ((100, 1), (60, 10)):
            with pytest.raises(errors.InputError, match=rf"prompt 0: the prompt \({prompt} tokens\) plus max_tokens "
                                                        rf"\({max_tokens}\) has {prompt + max_tokens} tokens"):
                b.sample([list(range(prompt))], {"max_tokens": max_tokens})
        b.sample([list(range(60))], {"max_tokens": 4})
    with skyrl_sdk.Backend(model="tiny") as tiny:
        assert tiny.engine.info.max_positions == 2048


# ---- a loss's declared outputs against the requested reduction ------------------------------------
def test_a_reduction_a_loss_cannot_serve_is_refused_before_its_forward_pass(backend, fragile_losses):
    _refused_without_a_trace(
        backend, lambda: backend.forward_backward(SFT, "sum_only_ce", {"loss_reduction": "seq_mean_token_mean"}),
        errors.LossConfigError, r"loss 'sum_only_ce' does not declare elementwise_loss among its outputs "
                                r"\['logprobs'\], so it cannot use loss_reduction 'seq_mean_token_mean'")
    assert fragile_losses == []  # refused before the forward pass
    backend.forward_backward(SFT, "sum_only_ce", {"loss_reduction": "token_mean"})  # a uniform one is served
    assert fragile_losses


def test_a_loss_that_declares_elementwise_loss_but_returns_none_is_the_plugin_s_fault(backend, fresh_plugins):  # noqa: F811
    @skyrl_sdk.register_loss("liar", description="declares what it does not return",
                             required_inputs=("target_tokens",), optional_inputs=("weights",),
                             outputs=("logprobs", "elementwise_loss"))
    def liar(batch, config):
        return LossOutput(loss=-batch.target_logprobs.sum())

    _refused_without_a_trace(
        backend, lambda: backend.forward_backward(SFT, "liar", {"loss_reduction": "seq_mean_token_mean"}),
        errors.PluginError, r"loss 'liar' \(plugin '.*'\) returned no elementwise_loss though it declares one")


# ---- TensorData and ids: one check on every input path --------------------------------------------
BAD_ARRAYS = {
    "uint64 2**64-1": (np.array([2**64 - 1] * 3, dtype=np.uint64), "beyond int64"),
    "datetime64": (np.array(["2020-01-01"] * 3, dtype="datetime64[D]"), "dtype datetime64"),
    "complex": (np.array([1 + 2j] * 3), "dtype complex128"),
    "strings": (np.array(["1.5"] * 3), "dtype <U3"),
    "objects": (np.array([1.0, 2.0, 3.0], dtype=object), "non-numeric"),
    "bools": (np.array([True, False, True]), "booleans"),
}


@pytest.mark.parametrize("name", BAD_ARRAYS)
def test_tensor_data_checks_its_values_however_it_is_built(name):
    array, match = BAD_ARRAYS[name]
    with pytest.raises(errors.InputError, match=match):
        types.TensorData(array)  # built directly (it used to coerce: 2**64-1 became -1.0)
    with pytest.raises(errors.InputError, match=match):
        types.TensorData.from_numpy(array)
    with pytest.raises(errors.InputError, match=match):
        types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": array})
    if name != "uint64 2**64-1" and name != "bools":  # as float32 weights those two are numbers
        with pytest.raises(errors.InputError, match=match):
            types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": array})


def test_a_uint64_weight_keeps_its_sign():
    datum = types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": np.array([2**64 - 1] * 3, dtype=np.uint64)})
    assert (datum.loss_fn_inputs["weights"].array > 1e19).all()


@pytest.mark.parametrize("form", ["list", "numpy", "torch", "tinker json"])
def test_bool_token_ids_are_refused(backend, form):
    bools = [True, False, True]
    value = {"list": bools, "numpy": np.array(bools), "torch": torch.tensor(bools),
             "tinker json": {"data": bools, "dtype": "int64"}}[form]
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "loss_fn_inputs": {"target_tokens": value}}
    _refused_without_a_trace(backend, lambda: backend.forward_backward([datum]), errors.InputError,
                             "expected integer token ids, got booleans")
    with pytest.raises(errors.InputError, match="expected integer token ids, got booleans"):
        types.ModelInput.from_ints(np.array(bools))
    with pytest.raises(errors.InputError, match="booleans"):
        tinker_json.tensor_from_json({"data": bools, "dtype": "int64"})


def test_bool_weights_are_a_mask():
    datum = types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": [True, False, True]})
    assert datum.loss_fn_inputs["weights"].array.tolist() == [1.0, 0.0, 1.0]


# ---- a call that fails mid-way leaves the pending gradients as they were ---------------------------
@pytest.fixture
def fragile_losses(fresh_plugins):  # noqa: F811
    """The losses of tests/_fragile.py; the list counts the micro-batches each saw."""
    seen: list[str] = []
    _fragile.declare(seen)
    return seen


MICRO = {"micro_batch_tokens": 8}  # one datum per micro-batch: earlier ones back-propagate first
FAILING = _fragile.marked(make_sft_data([4, 5, 6, 7], seed=3))


@pytest.mark.parametrize("loss,error", [("fragile_ce", _fragile.Boom), ("oom_ce", torch.OutOfMemoryError)])
def test_a_call_failing_mid_way_keeps_the_pending_gradients(fragile_losses, loss, error):
    with skyrl_sdk.Backend(seed=0, engine_config=MICRO, grad_accumulation="mean") as b, \
            skyrl_sdk.Backend(seed=0, engine_config=MICRO, grad_accumulation="mean") as reference:
        for backend in (b, reference):
            backend.forward_backward(SFT)
            backend.forward_backward(make_sft_data([3, 8], seed=4), "fragile_ce")
        before, seen = grads_of(b), len(fragile_losses)
        with pytest.raises(error) as info:
            b.forward_backward(FAILING, loss)
        assert fragile_losses[seen:] == [loss] * 4  # three micro-batches back-propagated before the failure
        assert info.value.__notes__ == [
            "forward_backward failed mid-call: this call's partial gradients were dropped; the pending gradients "
            "of the 2 earlier forward_backward call(s) since the last step were kept as they were"]
        _same(grads_of(b), before)
        # and the count of calls too: "mean" divides by 2, as for the reference that never failed
        assert b.optim_step(ADAM).metrics["num_forward_backward_calls"] == 2.0
        reference.optim_step(ADAM)
        assert_tensors_close(weights_of(b), weights_of(reference), atol=0.0, what="weights")
        with pytest.raises(_fragile.Boom):  # nothing pending: the failed call leaves nothing either
            b.forward_backward(FAILING, "fragile_ce")
        assert grads_of(b) == {} and b.pending_calls == 0


def test_keep_grads_on_error_off_drops_everything_and_says_so(fragile_losses):
    with skyrl_sdk.Backend(seed=0, engine_config={**MICRO, "keep_grads_on_error": False}) as b:
        b.forward_backward(SFT)
        with pytest.raises(_fragile.Boom) as info:
            b.forward_backward(FAILING, "fragile_ce")
        assert "the pending gradients of the 1 earlier forward_backward call(s) since the last step were dropped " \
               "too (keep_grads_on_error=False)" in info.value.__notes__[0]
        assert grads_of(b) == {} and b.pending_calls == 0
        assert b.optim_step(ADAM).metrics["no_gradient"] == 1.0


def test_shared_base_adapters_keep_their_pending_gradients(fragile_losses):
    from skyrl_sdk import SharedBase

    with SharedBase("tiny", engine_config=MICRO) as base:
        alice, bob = base.backend({"rank": 4}), base.backend({"rank": 8}, seed=1)
        alice.forward_backward(SFT)
        bob.forward_backward(RL, "ppo")
        mine, theirs = grads_of(alice), grads_of(bob)
        with pytest.raises(_fragile.Boom):
            alice.forward_backward(FAILING, "fragile_ce")
        _same(grads_of(alice), mine)
        _same(grads_of(bob), theirs)
        assert alice.optim_step(ADAM).metrics["no_gradient"] == 0.0


def test_keep_grads_on_error_is_switchable_per_call(fragile_losses):
    """The engine's default either way, and one call asking for the other: the pending gradients are
    kept (one more gradient buffer during that call) or dropped (none) as that call says."""
    with skyrl_sdk.Backend(seed=0, engine_config={**MICRO, "keep_grads_on_error": False}) as b:
        b.forward_backward(SFT)
        before = grads_of(b)
        with pytest.raises(_fragile.Boom) as info:
            b.forward_backward(FAILING, "fragile_ce", keep_grads_on_error=True)
        assert "were kept as they were" in info.value.__notes__[0]
        _same(grads_of(b), before)
        assert b.pending_calls == 1
    with skyrl_sdk.Backend(seed=0, engine_config=MICRO) as b:  # default: kept
        b.forward_backward(SFT)
        with pytest.raises(_fragile.Boom) as info:
            b.forward_backward(FAILING, "fragile_ce", keep_grads_on_error=False)
        assert "were dropped too (keep_grads_on_error=False)" in info.value.__notes__[0]
        assert grads_of(b) == {} and b.pending_calls == 0
        # the engine's default is unchanged for the next call
        b.forward_backward(SFT)
        before = grads_of(b)
        with pytest.raises(_fragile.Boom):
            b.forward_backward(FAILING, "fragile_ce")
        _same(grads_of(b), before)


def test_a_per_call_keep_grads_on_error_is_checked_before_compute(backend):
    _refused_without_a_trace(backend, lambda: backend.forward_backward(SFT, keep_grads_on_error="yes"),
                             errors.InputError, r"keep_grads_on_error: expected true, false or None, got 'yes'")

    class NoSwitch(type(backend.engine)):
        def run(self, data, loss, *, backward):  # a custom engine without the keyword
            return super().run(data, loss, backward=backward)

    engine = backend.engine
    try:
        backend.engine = object.__new__(NoSwitch)
        backend.engine.__dict__.update(engine.__dict__)
        _refused_without_a_trace(backend, lambda: backend.forward_backward(SFT, keep_grads_on_error=False),
                                 errors.InputError, r"keep_grads_on_error: engine 'local' cannot choose it per call")
    finally:
        backend.engine = engine
