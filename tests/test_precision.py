"""Mixed precision: dtype is the compute dtype, weights / gradients / AdamW moments stay float32."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.models.logprobs import target_logprobs
from skyrl_sdk.testing import assert_tensors_close, make_sft_data, torch_threads, weights_of

MIXED = {"dtype": "bfloat16"}
PURE_BF16 = {"dtype": "bfloat16", "master_dtype": "bfloat16"}
#: The issue's case: 30 AdamW steps at a full-fine-tuning learning rate on one batch.
STEPS, SMALL_LR = 30, types.AdamParams(learning_rate=1e-5)
BATCH = make_sft_data([24, 31, 17, 40], seed=1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def loss_drop(engine_config: dict, engine: str = "local") -> float:
    """How much the summed loss falls over :data:`STEPS` steps on :data:`BATCH`."""
    with skyrl_sdk.Backend(model="tiny", engine=engine, engine_config=engine_config) as backend:
        first = backend.forward_backward(BATCH, "cross_entropy").metrics["loss:sum"]
        for _ in range(STEPS):
            backend.optim_step(SMALL_LR)
            last = backend.forward_backward(BATCH, "cross_entropy").metrics["loss:sum"]
    return first - last


@pytest.fixture(scope="module")
def fp32_drop() -> float:
    drop = loss_drop({})
    assert drop > 5.0  # the test has something to compare
    return drop


# ---- configuration ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"dtype": "float16"}, "needs a dynamic loss scaler"),
        ({"dtype": "float64"}, "engine_config['dtype']"),
        ({"master_dtype": "bfloat16"}, "need dtype='bfloat16'"),
        ({"dtype": "bfloat16", "master_dtype": "float16"}, "engine_config['master_dtype']"),
        ({"gradient_checkpointing": 1}, "engine_config['gradient_checkpointing']: expected true or false"),
    ],
)
def test_bad_precision_options_are_refused_by_name(config, message):
    with pytest.raises(errors.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        skyrl_sdk.Backend(model="tiny", engine_config=config)


# ---- the target -----------------------------------------------------------------
def test_mixed_bf16_learns_like_fp32_where_pure_bf16_does_not(fp32_drop):
    mixed = loss_drop(MIXED)
    pure = loss_drop(PURE_BF16)
    assert mixed >= 0.9 * fp32_drop, (mixed, fp32_drop)
    assert pure < 0.5 * fp32_drop, (pure, fp32_drop)  # what the masters are for: pure bf16 rounds updates away


def test_masters_gradients_moments_and_outputs_are_float32():
    with skyrl_sdk.Backend(model="tiny", engine_config=MIXED) as mixed, skyrl_sdk.Backend(model="tiny") as fp32:
        out = mixed.forward_backward(BATCH, "cross_entropy")
        ref = fp32.forward_backward(BATCH, "cross_entropy")
        runner = mixed.engine.runner
        for name, p in runner.named_trainable():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        mixed.optim_step(SMALL_LR)
        for state in runner.optimizer.torch_optimizer.state.values():
            assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
        for got, want in zip(out.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
            lp, lp32 = got["logprobs"].to_numpy(), want["logprobs"].to_numpy()
            assert lp.dtype == np.float32
            diff = np.abs(lp - lp32).max()
            assert 0 < diff < 0.05, diff  # computed in bf16 (not identical), close to fp32


def test_pure_bf16_is_an_explicit_opt_in():
    with skyrl_sdk.Backend(model="tiny", engine_config=PURE_BF16) as backend:
        backend.forward_backward(BATCH, "cross_entropy")
        assert {p.dtype for _, p in backend.engine.runner.named_trainable()} == {torch.bfloat16}
        assert backend.engine.runner.autocast_dtype is None


# ---- the head: float32 after the matmul, fused == generic, chunked == whole ---------------
def _reference(hidden, weight, targets):
    """The plain formula under the same autocast: bf16 matmul, float32 log-softmax."""
    logits = F.linear(hidden, weight).float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_elements", [2**27, 7 * 50])
def test_fused_head_under_autocast_equals_the_plain_formula(chunk_elements):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (29,), generator=gen)
    upstream = torch.randn(29, generator=gen)
    results = []
    for fused in (True, False):
        hidden.grad = head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:  # a plain nn.Linear head: the fused (and, with small chunks, chunked) path
                lp, ent = target_logprobs(hidden, head, targets, 50, chunk_elements=chunk_elements)
            else:
                lp, ent = _reference(hidden, head.weight, targets)
        assert lp.dtype == torch.float32 and ent.dtype == torch.float32
        ((lp * upstream).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    (lp, ent, gh, gw), (lp_ref, ent_ref, gh_ref, gw_ref) = results
    assert gw.dtype == torch.float32 and gh.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
    # gradients: both through bf16 matmuls, summed in another order: bf16 rounding apart
    torch.testing.assert_close(gh, gh_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw, gw_ref, atol=2e-2, rtol=2e-2)


def test_chunked_backward_recomputes_in_the_forward_dtype():
    """Chunked scoring recomputes logits in backward, outside autocast: in the same bf16."""
    data = make_sft_data([40, 33], seed=4)
    grads = []
    for chunk in (2**27, 320 * 8):  # whole vs chunks of 8 tokens (vocab 320)
        with skyrl_sdk.Backend(model="tiny", engine_config={**MIXED, "logprob_chunk_elements": chunk}) as b:
            b.forward_backward(data, "cross_entropy")
            grads.append({n: p.grad.clone() for n, p in b.engine.runner.named_trainable()})
    for name, whole in grads[0].items():
        # weight gradients come out of bf16 matmuls: equal to bf16 rounding (2**-8) of their scale
        scale = float(whole.abs().max())
        torch.testing.assert_close(grads[1][name], whole, atol=2**-7 * scale, rtol=0, msg=name)


# ---- state and export --------------------------------------------------------------------
def test_save_state_keeps_float32_masters_and_resume_is_exact(tmp_path):
    batches = [make_sft_data([9, 14], seed=s) for s in range(4)]
    adam = types.AdamParams(learning_rate=1e-3)

    def train(backend, some):
        for data in some:
            backend.forward_backward(data, "cross_entropy")
            backend.optim_step(adam)

    with skyrl_sdk.Backend(model="tiny", engine_config=MIXED) as straight:
        train(straight, batches)
        want = weights_of(straight)
    with skyrl_sdk.Backend(model="tiny", engine_config=MIXED) as first:
        train(first, batches[:2])
        first.save_state(tmp_path / "state")
    for name in ("model.safetensors", "optimizer.safetensors"):
        with safe_open(str(tmp_path / "state" / name), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}, name
    # the float32 state loads into a float32 Backend too (same layout)
    with skyrl_sdk.Backend(model="tiny") as fp32:
        fp32.load_state(tmp_path / "state")
    with skyrl_sdk.Backend(model="tiny", engine_config=MIXED, seed=7) as resumed:
        resumed.load_state(tmp_path / "state")
        train(resumed, batches[2:])
        assert_tensors_close(weights_of(resumed), want, atol=0.0, what="resumed vs straight")


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4)])
def test_sampler_weights_are_bf16_and_load_in_transformers(tmp_path, lora):
    from transformers import AutoModelForCausalLM

    data = make_sft_data([21, 13], seed=2)
    with skyrl_sdk.Backend(model="tiny", lora=lora, engine_config=MIXED) as backend:
        backend.forward_backward(data, "cross_entropy")
        backend.optim_step(types.AdamParams(learning_rate=1e-2))
        trainer = backend.forward(data, "cross_entropy")
        backend.save_weights_for_sampler(tmp_path / "sampler")
    config = json.loads((tmp_path / "sampler" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "sampler" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert not any("lora_" in k for k in f.keys())
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sampler"))
    assert model.dtype == torch.bfloat16
    for datum, out in zip(data, trainer.loss_fn_outputs, strict=True):
        ids = torch.as_tensor(datum.model_input.to_ints()).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
        sampler_lp = torch.log_softmax(logits, -1).gather(1, targets.unsqueeze(-1)).squeeze(-1).numpy()
        # bf16 weights + bf16 residual stream (sampler) vs fp32 masters under autocast (trainer)
        assert np.abs(sampler_lp - out["logprobs"].to_numpy()).max() < 0.1
