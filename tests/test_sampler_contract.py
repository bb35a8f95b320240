"""What a sampler gets: the in-process engines' ``WeightsSource``, checked against independent
references (transformers loading the exported directory, peft loading the adapter tensors),
and the version the Backend moves whenever the weights change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.models.loading import quiet_peft_wrap
from skyrl_sdk.sampling import Sampler, WeightsSource
from skyrl_sdk.testing import make_sft_data

SEQ = [5, 9, 2, 7, 7, 1, 3, 8, 4]


def _train(backend, steps: int = 2) -> None:
    for _ in range(steps):
        backend.forward_backward(make_sft_data([8, 6]), "cross_entropy")
        backend.optim_step(types.AdamParams(learning_rate=5e-2))


def _forward_logprobs(backend) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs={"target_tokens": SEQ[1:]})
    return backend.forward([datum], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()


def _hf_logprobs(model) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQ[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(SEQ[1:])[:, None])[:, 0].numpy()


def test_full_fine_tuning_source_exports_and_streams_the_current_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    with skyrl_sdk.Backend(model="tiny") as b:
        _train(b)
        source = b.engine.weights_source()
        assert isinstance(source, WeightsSource) and not hasattr(source, "optim_step")
        assert (source.lora, source.dtype, source.eos_token_id) == (None, "float32", 257)
        live = dict(b.engine.loaded.module.state_dict())
        streamed = dict(source.base_weights())
        assert streamed.keys() == live.keys()
        assert all(streamed[k] is live[k] or torch.equal(streamed[k], live[k]) for k in live)
        source.export_base(tmp_path)
        exported = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        np.testing.assert_allclose(_hf_logprobs(exported), _forward_logprobs(b), atol=1e-5)
        with pytest.raises(errors.InputError, match="no LoRA adapter to read"):
            source.adapter_weights()


@pytest.mark.parametrize("shared", [False, True], ids=["solo", "shared-base"])
def test_lora_source_gives_the_bare_base_and_the_adapter_as_peft_saves_it(tmp_path, shared):
    """The base exported without the adapter, plus the adapter tensors loaded by peft, is the
    trained model: its logprobs equal the Backend's ``forward``."""
    import peft
    from transformers import AutoModelForCausalLM

    base = skyrl_sdk.SharedBase(model="tiny") if shared else None
    b = base.backend({"rank": 4}, seed=3) if shared else skyrl_sdk.Backend(model="tiny", lora={"rank": 4}, seed=3)
    try:
        _train(b)
        source = b.engine.weights_source()
        assert source.lora == types.LoraConfig(rank=4)
        adapter = source.adapter_weights()
        assert adapter.config["r"] == 4 and adapter.config["lora_alpha"] == 32
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter.tensors
        assert all(".lora_A." in k or ".lora_B." in k for k in adapter.tensors)
        assert not any("lora_" in k for k, _ in source.base_weights())
        source.export_base(tmp_path)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        untrained = _hf_logprobs(model)
        config = peft.LoraConfig(**{k: adapter.config[k] for k in ("r", "lora_alpha", "target_modules")})
        with quiet_peft_wrap():  # peft reads a deprecated transformers attribute while wrapping
            model = peft.get_peft_model(model, config)
        peft.set_peft_model_state_dict(model, adapter.tensors)
        np.testing.assert_allclose(_hf_logprobs(model.eval()), _forward_logprobs(b), atol=1e-5)
        assert np.abs(untrained - _forward_logprobs(b)).max() > 1e-2  # the adapter matters
        adapter.tensors[next(iter(adapter.tensors))].add_(1.0)  # copies: the caller may keep or change them
        np.testing.assert_allclose(_hf_logprobs(model.eval()), _forward_logprobs(b), atol=1e-5)
    finally:
        b.close()
        if base is not None:
            base.close()


def test_base_key_is_shared_by_the_adapters_of_one_base_only():
    with skyrl_sdk.SharedBase(model="tiny") as base:
        alice, bob = base.backend({"rank": 4}), base.backend({"rank": 4}, seed=1)
        reader = base.base_backend()
        keys = [x.engine.weights_source().base_key for x in (alice, bob, reader)]
        assert keys[0] == keys[1] == keys[2]
        assert not torch.equal(*(next(iter(x.engine.weights_source().adapter_weights().tensors.values()))
                                 for x in (alice, bob)))
    with skyrl_sdk.Backend(model="tiny", lora={"rank": 4}) as one, skyrl_sdk.Backend(model="tiny", lora={"rank": 4}) as two:
        assert one.engine.weights_source().base_key != two.engine.weights_source().base_key


def test_a_critic_has_no_weights_to_sample():
    with skyrl_sdk.Backend(model="tiny", role="critic") as critic:
        with pytest.raises(errors.InputError, match="sampling needs a policy model"):
            critic.sample([[1, 2]], types.SamplingParams(max_tokens=1))


def test_the_version_moves_on_every_weight_change_and_only_then(fresh_plugins, tmp_path):
    seen = []

    @skyrl_sdk.register_sampler("spy")
    class Spy(Sampler):
        name = "spy"

        def sample(self, request):
            seen.append(self.source.version)
            return []

    with skyrl_sdk.Backend(model="tiny", sampler="spy") as b:
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        b.forward(make_sft_data([4]), "cross_entropy")
        b.forward_backward(make_sft_data([4]), "cross_entropy")
        b.save_state(tmp_path / "s")
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        b.load_state(tmp_path / "s")
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        b.weights_changed()  # whoever changes the weights another way says so
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        assert b.get_info().sampler == "spy"
    assert seen == [0, 0, 1, 2, 3]
