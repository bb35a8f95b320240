"""Checkpoints, exports, LoRA and the critic role."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.engines.throughput import without_throughput
from skyrl_sdk.testing import assert_tensors_close, make_sft_data, weights_of

ADAM = types.AdamParams(learning_rate=5e-3, beta1=0.85, beta2=0.98, weight_decay=0.01, grad_clip_norm=1.0)


def _train(backend, batches):
    for data in batches:
        backend.forward_backward(data)
        backend.optim_step(ADAM)


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4)])
def test_resume_equals_never_stopping_even_with_another_seed(tmp_path, lora):
    batches = [make_sft_data([5, 9], seed=s) for s in range(4)]
    with skyrl_sdk.Backend(seed=0, lora=lora) as straight:
        _train(straight, batches)
        want = weights_of(straight)
    with skyrl_sdk.Backend(seed=0, lora=lora) as first:
        _train(first, batches[:2])
        first.save_state(tmp_path / "state")
    assert [p.name for p in tmp_path.iterdir()] == ["state"]  # no temporary leftovers
    with skyrl_sdk.Backend(seed=123, lora=lora) as resumed:
        resumed.load_state(tmp_path / "state", optimizer=True)
        _train(resumed, batches[2:])
        assert_tensors_close(weights_of(resumed), want, atol=1e-6)


def test_load_state_without_optimizer_resets_moments(tmp_path):
    batches = [make_sft_data([5, 9], seed=s) for s in range(2)]
    with skyrl_sdk.Backend(seed=0) as a:
        _train(a, batches[:1])
        a.save_state(tmp_path / "s")
        _train(a, batches[1:])
        with_moments = weights_of(a)
    with skyrl_sdk.Backend(seed=0) as b:
        b.load_state(tmp_path / "s", optimizer=False)
        _train(b, batches[1:])
        diff = max(float((weights_of(b)[k] - with_moments[k]).abs().max()) for k in with_moments)
        assert diff > 1e-6


def test_state_files_are_safetensors_and_json(tmp_path):
    with skyrl_sdk.Backend(seed=0) as b:
        _train(b, [make_sft_data([4], seed=0)])
        b.save_state(tmp_path / "s")
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == [".skyrl_checkpoint", "model.safetensors", "optimizer.safetensors", "skyrl_state.json"]
    meta = json.loads((tmp_path / "s" / "skyrl_state.json").read_text())
    assert meta["identity"]["architecture"] == "LlamaForCausalLM"
    assert meta["engine_state"]["step"] == 1


def test_state_of_another_model_is_refused(tmp_path):
    with skyrl_sdk.Backend(seed=0, lora=types.LoraConfig(rank=2)) as b:
        b.save_state(tmp_path / "lora")
    with skyrl_sdk.Backend(seed=0, role="critic") as c:
        c.save_state(tmp_path / "critic")
    with skyrl_sdk.Backend(seed=0) as full:
        before = weights_of(full)
        with pytest.raises(errors.CheckpointError, match="another model"):
            full.load_state(tmp_path / "lora")
        with pytest.raises(errors.CheckpointError, match="another model"):
            full.load_state(tmp_path / "critic")
        with pytest.raises(errors.CheckpointError, match="no checkpoint"):
            full.load_state(tmp_path / "missing")
        assert_tensors_close(weights_of(full), before, atol=0.0)


def test_save_refuses_to_overwrite_and_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    with skyrl_sdk.Backend(seed=0) as b:
        b.save_state(tmp_path / "s")
        with pytest.raises(errors.CheckpointError, match="already exists"):
            b.save_state(tmp_path / "s")
        b.save_state(tmp_path / "s", overwrite=True)

        def explode(directory, **kwargs):
            (directory / "config.json").write_text("{}")
            raise RuntimeError("disk full")

        monkeypatch.setattr(b.engine, "export_weights", explode)
        with pytest.raises(RuntimeError, match="disk full"):
            b.save_weights_for_sampler(tmp_path / "export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def _hf_logprobs(directory, data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory))
    out = []
    with torch.no_grad():
        for d in data:
            logits = model(input_ids=torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)).logits[0].float()
            tgt = torch.from_numpy(d.loss_fn_inputs["target_tokens"].array)
            out.append(torch.log_softmax(logits, -1).gather(1, tgt.unsqueeze(1)).squeeze(1).numpy())
    return out


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=4, alpha=16)])
def test_exported_directory_reproduces_backend_logprobs(tmp_path, lora):
    from transformers import AutoTokenizer

    data = make_sft_data([6, 10], seed=5)
    with skyrl_sdk.Backend(seed=0, lora=lora) as b:
        _train(b, [make_sft_data([8, 8], seed=s) for s in range(2)])
        want = b.forward(data).loss_fn_outputs
        b.save_weights_for_sampler(tmp_path / "hf")
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    for got, w in zip(_hf_logprobs(tmp_path / "hf", data), want, strict=True):
        np.testing.assert_allclose(got, w["logprobs"].to_numpy(), atol=2e-5)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.decode(tok("7+8=15")["input_ids"]) == "7+8=15"


# peft's PeftModel reads transformers' deprecated is_gradient_checkpointing (as our own
# models.loading.peft_model notes): the warning is about peft, not the export under test
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_adapter_only_export_loads_with_peft(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    data = make_sft_data([6], seed=5)
    with skyrl_sdk.Backend(seed=0, lora=types.LoraConfig(rank=4)) as b:
        _train(b, [make_sft_data([8, 8], seed=1)])
        want = b.forward(data).loss_fn_outputs[0]["logprobs"].to_numpy()
        b.save_weights_for_sampler(tmp_path / "base", merge_lora=True)
        b.save_weights_for_sampler(tmp_path / "adapter", merge_lora=False)
        # a base directory for the adapter: the initial (seed 0) weights
    with skyrl_sdk.Backend(seed=0) as base:
        base.save_weights_for_sampler(tmp_path / "init")
    base_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"))
    model = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter"))
    ids = torch.from_numpy(data[0].model_input.to_numpy()).unsqueeze(0)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    got = logp.gather(1, torch.from_numpy(data[0].loss_fn_inputs["target_tokens"].array).unsqueeze(1)).squeeze(1)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5)


def test_lora_trains_only_adapters_and_reports_info():
    with skyrl_sdk.Backend(seed=0, lora=types.LoraConfig(rank=4, train_unembed=False)) as b:
        info = b.get_info()
        assert info.is_lora and info.lora_rank == 4
        assert 0 < info.num_trainable_parameters < info.num_parameters
        names = [n for n, _ in b.engine.runner.named_trainable()]
        assert names and all("lora_" in n for n in names)
        assert not any("lm_head" in n for n in names)


def _critic_data(seed=0):
    rng = np.random.default_rng(seed)
    data = []
    for n in (6, 9, 4):
        tokens = rng.integers(0, 256, n)
        returns = ((tokens % 7) / 3.0 - 1.0).astype(np.float32)  # learnable from the current token
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                loss_fn_inputs={"values": np.zeros(n, np.float32), "returns": returns}))
    return data


def test_critic_value_loss_falls_and_forward_returns_values():
    data = _critic_data()
    losses = []
    with skyrl_sdk.Backend(seed=0, role="critic") as critic:
        for _ in range(25):
            out = critic.forward_backward(data, "value", {"value_clip": 10.0})
            losses.append(out.metrics["loss:sum"])
            critic.optim_step(types.AdamParams(learning_rate=1e-2))
        fwd = critic.forward(data, "ppo", {"value_clip": 10.0})  # Tinker's ppo on a critic = value loss
        assert fwd.loss_fn_outputs[0]["values"].shape == (6,)
    assert losses[-1] < 0.5 * losses[0]


def test_lora_on_a_tied_head_warns_nothing_and_exports_it_untied(tmp_path):
    """LoRA on the head of a model whose head is its input embedding: no warning (peft's about
    the tie is handled), the merged export writes the adapted head beside the embedding with
    ``tie_word_embeddings: false`` (a loader would tie the delta away), and reproduces the
    trained logprobs; the shared base's export too. Without the head adapted, it stays tied."""
    import warnings

    from arch_models import make_family_dir
    from skyrl_sdk import SharedBase
    from skyrl_sdk.models.checkpoint import load_tensors

    model = str(make_family_dir("mistral", tmp_path / "tied", tie_word_embeddings=True))
    data = make_sft_data([6, 5], seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with skyrl_sdk.Backend(model=model, lora=types.LoraConfig(rank=2)) as solo, SharedBase(model) as base, \
                base.backend(types.LoraConfig(rank=2)) as shared, \
                skyrl_sdk.Backend(model=model, lora=types.LoraConfig(rank=2, train_unembed=False)) as no_head:
            for name, backend in (("solo", solo), ("shared", shared), ("no_head", no_head)):
                backend.forward_backward(data)
                backend.optim_step(types.AdamParams(learning_rate=1e-2))
                trained = [o["logprobs"].to_numpy() for o in backend.forward(data).loss_fn_outputs]
                backend.save_weights_for_sampler(tmp_path / name)
                config = json.loads((tmp_path / name / "config.json").read_text())
                weights = load_tensors(tmp_path / name / "model.safetensors")
                assert config["tie_word_embeddings"] is (name == "no_head"), name
                assert ("lm_head.weight" in weights) is (name != "no_head"), name
                with skyrl_sdk.Backend(model=str(tmp_path / name)) as again:
                    for got, expected in zip(again.forward(data).loss_fn_outputs, trained, strict=True):
                        np.testing.assert_allclose(got["logprobs"].to_numpy(), expected, atol=2e-5)


def test_a_critic_export_says_what_it_is_and_never_loads_as_a_policy(tmp_path):
    """A critic's save_weights_for_sampler writes its backbone and value head (no lm_head),
    warns how to load it, and leaves a README.md saying the same; skyrl-sdk refuses it as a
    policy (a random lm_head otherwise) and loads it back as a critic. A policy's export:
    no warning, no README."""
    import warnings

    from transformers import AutoModel

    data = _critic_data()
    with skyrl_sdk.Backend(seed=0, role="critic") as critic:
        critic.forward_backward(data)
        critic.optim_step(types.AdamParams(learning_rate=1e-2))
        values = [o["values"].to_numpy() for o in critic.forward(data).loss_fn_outputs]
        with pytest.warns(errors.CriticExportWarning) as caught:
            critic.save_weights_for_sampler(tmp_path / "critic")
    message = str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's line
    for part in (str(tmp_path / "critic"), "no lm_head", "role='critic'", "AutoModel", "random lm_head"):
        assert part in message, message
    card = (tmp_path / "critic" / "README.md").read_text()
    assert "This directory is a critic (value model) export" in card and "role='critic'" in card
    with pytest.raises(errors.ModelLoadError, match=r"is a critic export .*load it with role='critic'"):
        skyrl_sdk.Backend(model=str(tmp_path / "critic"))
    AutoModel.from_pretrained(str(tmp_path / "critic"))  # the backbone alone, as the note says
    with skyrl_sdk.Backend(model=str(tmp_path / "critic"), role="critic") as again:
        for got, expected in zip(again.forward(data).loss_fn_outputs, values, strict=True):
            np.testing.assert_allclose(got["values"].to_numpy(), expected, atol=1e-6)
    with warnings.catch_warnings(), skyrl_sdk.Backend(seed=0) as policy:
        warnings.simplefilter("error")
        policy.save_weights_for_sampler(tmp_path / "policy")
    assert not (tmp_path / "policy" / "README.md").exists()


def test_a_critic_forward_reads_the_values_without_value_inputs():
    """``critic.forward([datum])`` with no ``values`` / ``returns``: the values (as a forward
    with them gives), no loss, no state change; a policy's datums as they are work too.
    ``forward_backward`` still requires them, and half of them is refused."""
    data = _critic_data()
    bare = [types.Datum(model_input=d.model_input, loss_fn_inputs={}) for d in data]
    policy_like = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": np.ones(d.model_input.length, np.int64), "weights": np.ones(d.model_input.length, np.float32),
        "logprobs": np.zeros(d.model_input.length, np.float32), "advantages": np.ones(d.model_input.length, np.float32)})
        for d in data]
    with skyrl_sdk.Backend(seed=0, role="critic") as critic:
        critic.forward_backward(data)
        critic.optim_step(types.AdamParams(learning_rate=1e-2))  # values no longer ~0
        before = weights_of(critic)
        with_inputs = critic.forward(data)
        for datums in (bare, policy_like):
            out = critic.forward(datums)
            assert without_throughput(out.metrics) == {"num_tokens:sum": float(sum(d.model_input.length for d in data))}
            for got, expected in zip(out.loss_fn_outputs, with_inputs.loss_fn_outputs, strict=True):
                assert set(got) == {"values"}
                np.testing.assert_array_equal(got["values"].to_numpy(), expected["values"].to_numpy())
        assert_tensors_close(weights_of(critic), before, atol=0.0)
        assert not critic.engine.runner.has_pending_grads()
        with pytest.raises(errors.DatumError, match=r"loss 'value' requires input 'values'"):
            critic.forward_backward(bare)
        half = [types.Datum(model_input=d.model_input, loss_fn_inputs={"returns": d.loss_fn_inputs["returns"]})
                for d in data]
        with pytest.raises(errors.DatumError, match=r"requires input 'values'"):
            critic.forward(half)  # one of the two: the call computes the loss and needs both
        with pytest.raises(errors.DatumError, match="differ from datum 0"):
            critic.forward(bare[:1] + data[1:])



def test_load_state_with_a_missing_optimizer_file_changes_nothing(tmp_path):
    with skyrl_sdk.Backend(seed=0) as a:
        _train(a, [make_sft_data([5, 9], seed=0)])
        a.save_state(tmp_path / "s")
    (tmp_path / "s" / "optimizer.safetensors").unlink()
    with skyrl_sdk.Backend(seed=1) as b:
        before = weights_of(b)
        b.forward_backward(make_sft_data([4], seed=2))
        with pytest.raises(errors.CheckpointError, match="optimizer.safetensors"):
            b.load_state(tmp_path / "s", optimizer=True)
        assert_tensors_close(weights_of(b), before, atol=0.0)
        assert b.engine.runner.has_pending_grads()
        b.load_state(tmp_path / "s", optimizer=False)  # weights alone still load
