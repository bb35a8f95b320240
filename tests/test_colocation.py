"""A trainer and a sampler with its own copy of the weights (vLLM) on one device: the Backend hands
the device to the sampler once per batch of samples and back once before the trainer computes
(``Sampler.before_training``), and with ``engine_config["offload_while_sampling"]`` the trainer's
parameters, gradients and AdamW moments wait in host memory meanwhile, coming back bit for bit.

The sampler here is a stand-in that records what the Backend does around it (vLLM's own side of
the policy is tested in plugins/skyrl-sdk-vllm/tests)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.sampling import Sampler
from skyrl_sdk.testing import assert_tensors_close, fresh_plugins, make_rl_data, weights_of  # noqa: F401

EVENTS: list[str] = []
ADAM = types.AdamParams(learning_rate=1e-2)


class OwnCopySampler(Sampler):
    """Records each sample and each ``before_training``; reads the weights as vLLM's sync does."""

    name = "own_copy"
    own_weights = True

    def __init__(self, *, source, config):
        super().__init__(source=source, config=config)
        self.copies: list[dict[str, torch.Tensor]] = []

    def sample(self, request):
        EVENTS.append("sample")
        self.copies.append({n: t.detach().clone() for n, t in self.source.base_weights()})
        seq = types.SampledSequence(tokens=[1], logprobs=[0.0], stop_reason="length")
        return [types.SampleOutput(sequences=[seq] * request.num_samples) for _ in request.prompts]

    def before_training(self):
        EVENTS.append("before_training")


@pytest.fixture
def own_copy(fresh_plugins):  # noqa: F811
    EVENTS.clear()
    skyrl_sdk.register_sampler("own_copy")(OwnCopySampler)
    yield


def _rl_step(b, data):
    b.sample([[5, 6, 7]], {"max_tokens": 1})
    b.sample([[8, 9]], {"max_tokens": 1})  # one batch of samples in several calls
    b.forward(data, "cross_entropy")
    b.forward_backward(data, "ppo")
    b.optim_step(ADAM)


@pytest.mark.parametrize("lora", [None, {"rank": 4}])
def test_the_device_changes_hands_once_per_turn_and_offloading_changes_nothing(own_copy, lora):
    data = make_rl_data([6, 9], seed=0)
    with skyrl_sdk.Backend(model="tiny", lora=lora, sampler="own_copy",
                           engine_config={"offload_while_sampling": True}) as b, \
            skyrl_sdk.Backend(model="tiny", lora=lora, sampler="own_copy") as reference:
        for _ in range(3):
            _rl_step(b, data)
        offload = b.engine.trainer_offload
        assert EVENTS == ["sample", "sample", "before_training"] * 3
        # one move each way per RL step, however many sample and training calls it has
        assert (offload.offloads, offload.reloads, offload.offloaded) == (3, 3, False)
        EVENTS.clear()
        for _ in range(3):
            _rl_step(reference, data)
        assert reference.engine.trainer_offload is None
        # the same weights, AdamW moments and samples' weights as a trainer that never left the device
        assert_tensors_close(weights_of(b), weights_of(reference), atol=0.0, what="weights")
        mine, theirs = b.engine.runner.optimizer.state_items(), reference.engine.runner.optimizer.state_items()
        assert_tensors_close(dict(mine), dict(theirs), atol=0.0, what="AdamW moments")
        for got, want in zip(b.sampler.copies, reference.sampler.copies, strict=True):
            assert_tensors_close(got, want, atol=0.0, what="the weights the sampler read")


def test_while_sampling_every_trainer_tensor_is_in_fresh_host_storage(own_copy, tmp_path):
    data = make_rl_data([6, 9], seed=0)
    with skyrl_sdk.Backend(model="tiny", sampler="own_copy", engine_config={"offload_while_sampling": True}) as b:
        b.forward_backward(data, "ppo")
        b.optim_step(ADAM)
        b.forward_backward(data, "ppo")  # pending gradients go too
        params = {n: p for n, p in b.engine.loaded.module.named_parameters()}
        before = {n: (p.data_ptr(), p.grad.data_ptr() if p.grad is not None else None) for n, p in params.items()}
        moments = {k: t.data_ptr() for k, t in b.engine.runner.optimizer.state_items() if "step" not in k}
        b.sample([[5, 6, 7]], {"max_tokens": 1})
        offload = b.engine.trainer_offload
        assert offload.offloaded
        # parameters, pending gradients and every AdamW state tensor, each once
        expected = sum(p.numel() * p.element_size() for p in params.values())
        expected += sum(p.grad.numel() * p.grad.element_size() for p in params.values() if p.grad is not None)
        expected += sum(t.numel() * t.element_size() for _, t in b.engine.runner.optimizer.state_items())
        assert offload.last_bytes == expected
        for n, p in params.items():
            assert p.device.type == "cpu" and p.data_ptr() != before[n][0], n
            assert before[n][1] is None or p.grad.data_ptr() != before[n][1], n
        for k, t in b.engine.runner.optimizer.state_items():
            assert k not in moments or t.data_ptr() != moments[k], k
        # a save or an export reads the tensors where they are: no trip back, the same files
        b.save_state(tmp_path / "offloaded")
        b.save_weights_for_sampler(tmp_path / "export")
        assert offload.offloaded and offload.reloads == 0 and EVENTS == ["sample"]
        b.forward_backward(data, "ppo")
        assert not offload.offloaded and offload.reloads == 1 and EVENTS == ["sample", "before_training"]
        b.zero_grad()
        b.save_state(tmp_path / "on_device")
    for name in ("model.safetensors", "optimizer.safetensors"):
        saved, reference = load_file(str(tmp_path / "offloaded" / name)), load_file(str(tmp_path / "on_device" / name))
        assert saved.keys() == reference.keys()
        assert all(torch.equal(saved[k], reference[k]) for k in saved), name


def test_a_sampler_that_decodes_on_the_trainer_never_offloads_it():
    with skyrl_sdk.Backend(model="tiny", engine_config={"offload_while_sampling": True}) as b:
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        b.forward_backward(make_rl_data([6], seed=0), "ppo")
        assert b.engine.trainer_offload.offloads == 0


def test_a_shared_base_refuses_offloading_by_name():
    with pytest.raises(errors.InputError, match=r"engine_config\['offload_while_sampling'\]: a shared base"):
        skyrl_sdk.SharedBase("tiny", engine_config={"offload_while_sampling": True})
