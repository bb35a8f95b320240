"""Sampling: logprobs agree with forward, seeds reproduce, stops and limits are honoured."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import errors, types


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(seed=0) as b:
        yield b


def test_sampled_logprobs_agree_with_forward(backend):
    prompts = [[1, 2, 3, 4], [50, 60]]
    outs = backend.sample(prompts, types.SamplingParams(max_tokens=12, temperature=1.0, seed=3), num_samples=2)
    assert len(outs) == 2 and all(len(o.sequences) == 2 for o in outs)
    data = []
    for prompt, out in zip(prompts, outs):
        for seq in out.sequences:
            full = prompt + seq.tokens
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:]}))
    fwd = backend.forward(data)
    i = 0
    for prompt, out in zip(prompts, outs):
        for seq in out.sequences:
            lp = fwd.loss_fn_outputs[i]["logprobs"].to_numpy()[len(prompt) - 1:]
            np.testing.assert_allclose(np.array(seq.logprobs), lp, atol=1e-3)
            i += 1


def test_seed_reproduces_and_max_tokens_limits(backend):
    params = types.SamplingParams(max_tokens=7, temperature=1.0, seed=11)
    a = backend.sample([[5, 6, 7]], params)[0].sequences[0]
    b = backend.sample([[5, 6, 7]], params)[0].sequences[0]
    assert a.tokens == b.tokens
    assert len(a.tokens) <= 7
    eos = backend.tokenizer.eos_token_id
    if a.tokens[-1] == eos:
        assert a.stop_reason == "stop"
    else:
        assert len(a.tokens) == 7 and a.stop_reason == "length"


def test_stop_token_ends_the_sequence(backend):
    greedy = backend.sample([[10, 11, 12]], types.SamplingParams(max_tokens=8, temperature=0.0))[0].sequences[0]
    stop = greedy.tokens[2]
    cut = backend.sample([[10, 11, 12]], types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop]))[0].sequences[0]
    assert cut.stop_reason == "stop"
    assert cut.tokens == greedy.tokens[: greedy.tokens.index(stop) + 1]


def test_prompt_logprobs_match_forward(backend):
    prompt = [3, 9, 27, 81, 243]
    out = backend.sample([prompt], types.SamplingParams(max_tokens=1), prompt_logprobs=True)[0]
    fwd = backend.forward([types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                                       loss_fn_inputs={"target_tokens": prompt[1:]})])
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)


def test_bad_prompts_are_rejected(backend):
    with pytest.raises(errors.InputError, match=r"prompt 1: token ids must be in \[0, 320\).*got 999"):
        backend.sample([[1, 2], [999]], types.SamplingParams())
    with pytest.raises(errors.InputError, match="top_p"):
        types.SamplingParams(top_p=0.0)
