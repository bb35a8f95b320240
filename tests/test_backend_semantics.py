"""Tinker semantics of the local engine, each against an independent reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.models.loading import load_model
from skyrl_sdk.testing import assert_tensors_close, count_micro_batches, grads_of, weights_of


def hf_reference_logprobs(data, seed=0):
    """log p(target_tokens[t] | input[:t+1]) straight from the HF model, one datum at a time."""
    model = load_model("tiny", seed=seed).module
    out = []
    with torch.no_grad():
        for d in data:
            ids = torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)
            logits = model(input_ids=ids).logits[0].float()
            tgt = torch.from_numpy(d.loss_fn_inputs["target_tokens"].array)
            out.append(torch.log_softmax(logits, -1).gather(1, tgt.unsqueeze(1)).squeeze(1))
    return out


def test_logprobs_match_hf_forward_with_unshifted_targets(sft_data):
    with skyrl_sdk.Backend(model="tiny", seed=0) as backend:
        out = backend.forward(sft_data, "cross_entropy")
    ref = hf_reference_logprobs(sft_data)
    for got, want in zip(out.loss_fn_outputs, ref, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want.numpy(), atol=2e-5)
    expected_loss = -sum(float((torch.from_numpy(d.loss_fn_inputs["weights"].array) * r).sum()) for d, r in zip(sft_data, ref, strict=True))
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert out.metrics["num_tokens:sum"] == sum(d.model_input.length for d in sft_data)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert all(k.count(":") == 1 for k in out.metrics)


def test_successive_calls_add_up_to_one_call(sft_data):
    with skyrl_sdk.Backend(seed=0) as a, skyrl_sdk.Backend(seed=0) as b:
        a.forward_backward(sft_data[:2])
        a.forward_backward(sft_data[2:])
        b.forward_backward(sft_data)
        assert_tensors_close(grads_of(a), grads_of(b), atol=1e-5, rtol=1e-5)
        a.optim_step(types.AdamParams(learning_rate=1e-3))
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        assert_tensors_close(weights_of(a), weights_of(b), atol=1e-6)


@pytest.mark.parametrize("config, split", [
    ({"micro_batch_tokens": 16}, True),
    ({"micro_batch_tokens": 24, "batching": "pack"}, True),
    ({"micro_batch_tokens": 100000, "batching": "pack"}, False),  # packing alone
])
def test_invariant_to_micro_batching_and_packing(sft_data, config, split):
    with skyrl_sdk.Backend(seed=0, engine_config={"micro_batch_tokens": 100000}) as ref, \
            skyrl_sdk.Backend(seed=0, engine_config=config) as other:
        with count_micro_batches() as boundaries:
            out_ref = ref.forward_backward(sft_data)
        assert boundaries == [0]  # the reference is one micro-batch
        with count_micro_batches() as boundaries:
            out = other.forward_backward(sft_data)
        assert (boundaries[0] > 0) == split  # more than one micro-batch ran where the test says so
        assert out.metrics["loss:sum"] == pytest.approx(out_ref.metrics["loss:sum"], rel=1e-5)
        for x, y in zip(out.loss_fn_outputs, out_ref.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=2e-5)
        assert_tensors_close(grads_of(other), grads_of(ref), atol=2e-5, rtol=1e-4)
        ref.optim_step(types.AdamParams(learning_rate=1e-3))
        other.optim_step(types.AdamParams(learning_rate=1e-3))
        assert_tensors_close(weights_of(other), weights_of(ref), atol=1e-5)


def test_packed_rows_do_not_attend_across_sequences(sft_data):
    """One packed row with restarting position_ids equals scoring each sequence alone."""
    with skyrl_sdk.Backend(seed=0, engine_config={"batching": "pack", "micro_batch_tokens": 100000}) as packed:
        out = packed.forward(sft_data)
    ref = hf_reference_logprobs(sft_data)
    for got, want in zip(out.loss_fn_outputs, ref, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want.numpy(), atol=2e-5)


def test_forward_leaves_no_trace(sft_data):
    with skyrl_sdk.Backend(seed=0) as backend:
        before = weights_of(backend)
        backend.forward(sft_data)
        assert grads_of(backend) == {}
        res = backend.optim_step(types.AdamParams(learning_rate=1.0))
        assert res.metrics["grad_norm"] == 0.0
        assert_tensors_close(weights_of(backend), before, atol=0.0)


def _bad_batches(good):
    n = good.model_input.length
    return {
        "token out of vocab": types.Datum(model_input=good.model_input,
                                          loss_fn_inputs={"target_tokens": np.full(n, 10_000), "weights": np.ones(n)}),
        "wrong length": types.Datum(model_input=good.model_input,
                                    loss_fn_inputs={"target_tokens": np.zeros(n + 1, dtype=np.int64), "weights": np.ones(n + 1)}),
        "non-finite weight": types.Datum(model_input=good.model_input,
                                         loss_fn_inputs={"target_tokens": np.zeros(n, dtype=np.int64), "weights": np.full(n, np.nan)}),
        "missing targets": types.Datum(model_input=good.model_input, loss_fn_inputs={"weights": np.ones(n)}),
    }


@pytest.mark.parametrize("case", ["token out of vocab", "wrong length", "non-finite weight", "missing targets"])
def test_bad_input_leaves_no_trace(sft_data, case):
    with skyrl_sdk.Backend(seed=0) as backend:
        backend.forward_backward(sft_data[:2])
        grads = grads_of(backend)
        bad = _bad_batches(sft_data[0])[case]
        with pytest.raises(errors.DatumError) as info:
            backend.forward_backward([sft_data[2], sft_data[3], bad])
        assert "datum 2" in str(info.value)
        assert isinstance(info.value, ValueError)
        assert_tensors_close(grads_of(backend), grads, atol=0.0)


def test_bad_loss_and_config_and_empty_data_leave_no_trace(sft_data):
    with skyrl_sdk.Backend(seed=0) as backend:
        before = weights_of(backend)
        with pytest.raises(errors.UnknownLossError, match="cross_entropy"):
            backend.forward_backward(sft_data, "no_such_loss")
        with pytest.raises(errors.LossConfigError, match="takes no loss_fn_config"):
            backend.forward_backward(sft_data, "cross_entropy", {"beta": 1.0})
        with pytest.raises(errors.InputError, match="empty"):
            backend.forward_backward([], "cross_entropy")
        with pytest.raises(errors.AdamParamsError, match="beta1"):
            backend.optim_step(types.AdamParams(beta1=1.5))
        assert grads_of(backend) == {}
        assert_tensors_close(weights_of(backend), before, atol=0.0)


def test_mixed_input_keys_rejected(sft_data):
    d0 = sft_data[0]
    n = d0.model_input.length
    no_weights = types.Datum(model_input=d0.model_input, loss_fn_inputs={"target_tokens": np.zeros(n, dtype=np.int64)})
    with skyrl_sdk.Backend(seed=0) as backend:
        with pytest.raises(errors.DatumError, match="datum 1"):
            backend.forward_backward([d0, no_weights])


def test_grad_accumulation_mean_scales_by_number_of_calls(sft_data):
    with skyrl_sdk.Backend(seed=0, grad_accumulation="mean") as mean, skyrl_sdk.Backend(seed=0) as total:
        for backend in (mean, total):
            backend.forward_backward(sft_data[:2])
            backend.forward_backward(sft_data[2:])
        g_mean = mean.optim_step(types.AdamParams(learning_rate=0.0)).metrics["grad_norm"]
        g_sum = total.optim_step(types.AdamParams(learning_rate=0.0)).metrics["grad_norm"]
        assert g_mean == pytest.approx(g_sum / 2, rel=1e-6)


def test_non_finite_gradient_skips_the_step(sft_data):
    with skyrl_sdk.Backend(seed=0) as backend:
        before = weights_of(backend)
        huge = [types.Datum(model_input=d.model_input,
                            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"].array,
                                            "weights": np.full(d.model_input.length, 3e38, dtype=np.float32)})
                for d in sft_data]
        backend.forward_backward(huge)
        res = backend.optim_step(types.AdamParams(learning_rate=1e-2))
        assert res.metrics["skipped"] == 1.0
        assert not np.isfinite(res.metrics["grad_norm"])
        assert grads_of(backend) == {}
        assert_tensors_close(weights_of(backend), before, atol=0.0)


def test_target_tokens_topk_distillation():
    rng = np.random.default_rng(3)
    n, k = 6, 4
    tokens = rng.integers(0, 256, n)
    targets = rng.integers(0, 256, (n, k))
    weights = rng.random((n, k)).astype(np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    with skyrl_sdk.Backend(seed=0) as backend:
        out = backend.forward([datum])
    model = load_model("tiny", seed=0).module
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(tokens).unsqueeze(0)).logits[0].float(), -1)
    ref = logp.gather(1, torch.from_numpy(targets))
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), ref.numpy(), atol=2e-5)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(torch.from_numpy(weights) * ref).sum()), rel=1e-5)


def _record_logprob_chunks(monkeypatch) -> list[tuple[int, int]]:
    """``(tokens, chunk)`` of every call of the fused log-prob head (the path ``tiny`` takes)."""
    from skyrl_sdk.models import logprobs

    calls, real = [], logprobs.linear_target_logprobs

    def recording(weight, bias, hidden, targets, chunk, want_entropy):
        calls.append((int(hidden.shape[0]), int(chunk)))
        return real(weight, bias, hidden, targets, chunk, want_entropy)

    monkeypatch.setattr(logprobs, "linear_target_logprobs", recording)
    return calls


def test_chunked_logprobs_equal_unchunked(sft_data, monkeypatch):
    calls = _record_logprob_chunks(monkeypatch)
    with skyrl_sdk.Backend(seed=0) as full, skyrl_sdk.Backend(seed=0, engine_config={"logprob_chunk_elements": 320 * 5}) as chunked:
        a = full.forward_backward(sft_data)
        assert calls and all(tokens <= chunk for tokens, chunk in calls)  # one chunk per call
        calls.clear()
        b = chunked.forward_backward(sft_data)
        assert calls and all(chunk == 5 for _, chunk in calls)  # 320 * 5 elements: 5 tokens of vocab 320
        assert sum(-(-tokens // chunk) for tokens, chunk in calls) > len(calls)  # scored in more chunks than calls
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-6)
        assert a.metrics["entropy_loss:sum"] == pytest.approx(b.metrics["entropy_loss:sum"], rel=1e-6)
        assert_tensors_close(grads_of(full), grads_of(chunked), atol=5e-6, rtol=1e-5)


def test_engine_config_and_names_are_validated():
    with pytest.raises(errors.InputError, match="micro_batch_size"):
        skyrl_sdk.Backend(engine_config={"micro_batch_size": 3})
    with pytest.raises(errors.UnknownNameError, match="local"):
        skyrl_sdk.Backend(engine="nope")
    with pytest.raises(errors.UnknownNameError, match="tinker"):
        skyrl_sdk.Backend(dialect="nope")
    with pytest.raises(errors.ModelLoadError, match="no config.json"):
        skyrl_sdk.Backend(model="/tmp")
    with pytest.raises(errors.ModelLoadError, match="not 'tiny'"):
        skyrl_sdk.Backend(model="/definitely/not/here")


def test_tiny_weights_are_bit_identical_for_a_seed():
    a = load_model("tiny", seed=7).module.state_dict()
    b = load_model("tiny", seed=7).module.state_dict()
    c = load_model("tiny", seed=8).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_shipped_tiny_assets_match_their_generator(tmp_path):
    """The files in assets/tiny are exactly what scripts/make_tiny_assets.py writes."""
    import json

    from skyrl_sdk.models.loading import TINY_DIR, build_tiny_tokenizer, tiny_config

    build_tiny_tokenizer().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((TINY_DIR / "tokenizer.json").read_text())
    shipped, generated = json.loads((TINY_DIR / "config.json").read_text()), json.loads(json.dumps(tiny_config().to_dict()))
    shipped.pop("transformers_version"), generated.pop("transformers_version")  # the writer's stamp (5.16-5.24 run)
    assert shipped == generated
