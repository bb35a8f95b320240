"""A sampler that runs apart from the trainer (``Sampler.runs_apart``: engines on devices of their own)
samples without the Backend's lock while its weights are current, so a training call in progress
does not delay it; when the weights moved, it syncs them first, holding the lock."""

from __future__ import annotations

import threading

import skyrl_sdk
from _limits import HANG_S
from skyrl_sdk import types
from skyrl_sdk.sampling import Sampler
from skyrl_sdk.testing import make_sft_data, training_call_in_progress
from skyrl_sdk.types import SampledSequence, SampleOutput


def _apart_sampler():
    calls = []

    @skyrl_sdk.register_sampler("apart")
    class Apart(Sampler):
        name = "apart"
        runs_apart = True

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.synced = self.source.version

        def weights_current(self):
            return self.synced == self.source.version

        def sync_weights(self):
            calls.append(("sync", self.source.version))
            self.synced = self.source.version

        def sample(self, request):
            calls.append(("sample", self.synced))
            return [SampleOutput(sequences=[SampledSequence(tokens=[1], logprobs=[0.0], stop_reason="length")]) for _ in request.prompts]

    return calls


def test_a_sample_with_current_weights_does_not_wait_for_a_training_call(fresh_plugins):
    calls = _apart_sampler()
    with skyrl_sdk.Backend(model="tiny", sampler="apart") as b:
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        assert b.sampler.runs_apart
        done = threading.Event()
        with training_call_in_progress(b):
            worker = threading.Thread(target=lambda: (b.sample([[1]], types.SamplingParams(max_tokens=1)), done.set()))
            worker.start()
            assert done.wait(HANG_S), "the sample waited for the training call"
        worker.join(HANG_S)
        b.forward_backward(make_sft_data([4]), "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        b.sample([[1]], types.SamplingParams(max_tokens=1))  # the weights moved: synced first
    assert calls == [("sample", 0), ("sample", 0), ("sync", 1), ("sample", 1)]


def test_a_sampler_on_the_trainers_devices_samples_holding_the_lock(fresh_plugins):
    with skyrl_sdk.Backend(model="tiny") as b:
        b.sample([[1]], types.SamplingParams(max_tokens=1))
        assert not b.sampler.runs_apart and b.sampler.weights_current()
