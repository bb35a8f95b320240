"""``Backend(sampler="vllm")`` on full fine-tuning: the built-in sampler's semantics, checked
against ``forward`` and against the built-in sampler on the same weights, and the weights kept
in sync after training. One engine serves the module (starting one takes seconds)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from vllm_testutil import SMALL, forward_logprobs, mirror, train

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.sampling import SampleRequest

PROMPT = list(range(5, 40))
GREEDY = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the vLLM-sampled Backend, a built-in-sampled Backend with the same initial weights)."""
    config = {**SMALL, "engine_args": {"disable_log_stats": False}}  # the prefix-cache test reads vLLM's counters
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=config) as b, \
            skyrl_sdk.Backend(model="tiny") as ref:
        yield b, ref


def test_logprobs_are_forwards_and_samples_are_grouped_per_prompt(pair):
    b, _ = pair
    short = [9, 8, 7]
    out = b.sample([PROMPT, short, PROMPT], {"max_tokens": 10, "seed": 11}, num_samples=3)
    assert [len(o.sequences) for o in out] == [3, 3, 3]
    worst = 0.0
    for prompt, o in zip([PROMPT, short, PROMPT], out, strict=True):
        for s in o.sequences:
            assert len(s.tokens) == len(s.logprobs) == 10 and s.stop_reason == "length"
            worst = max(worst, float(np.abs(np.array(s.logprobs) - forward_logprobs(b, prompt, s.tokens)).max()))
    assert worst < 1e-3, worst  # the bound (float32); measured about 5e-7
    # a prompt sent twice gets distinct samples (one request of 6, as the built-in draws 6 rows)
    assert len({tuple(s.tokens) for s in out[0].sequences + out[2].sequences}) == 6
    assert b.get_info().sampler == "vllm" and b.sampler.describe().startswith("vllm 0.")


@pytest.mark.parametrize("stop", [None, [], "token", "string"])
def test_greedy_samples_and_stop_rules_equal_the_builtin_sampler(pair, stop, tmp_path):
    b, ref = pair
    mirror(ref, b, tmp_path / "state")
    free = ref.sample([PROMPT], {**GREEDY, "stop": []})[0].sequences[0].tokens
    if stop == "token":
        stop = [free[4]]
    elif stop == "string":  # a printable character the greedy run makes after its first two tokens
        ascii_at = [i for i, t in enumerate(free) if i >= 2 and 33 <= t < 127]
        assert ascii_at, free
        stop = [chr(free[ascii_at[0]])]
    want = ref.sample([PROMPT], {**GREEDY, "stop": stop})[0].sequences[0]
    got = b.sample([PROMPT], {**GREEDY, "stop": stop})[0].sequences[0]
    assert (got.tokens, got.stop_reason) == (want.tokens, want.stop_reason)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    if stop not in (None, []):
        assert got.stop_reason == "stop" and len(got.tokens) < 12


def test_weights_follow_training_without_any_user_action(pair):
    b, _ = pair
    before = b.sample([PROMPT], {"max_tokens": 8, "seed": 2})[0].sequences[0]
    old = forward_logprobs(b, PROMPT, before.tokens)
    train(b)
    assert b.sampler.last_sync is None or b.sampler.last_sync["version"] < b.sampler.source.version
    after = b.sample([PROMPT], {"max_tokens": 8, "seed": 2})[0].sequences[0]
    assert b.sampler.last_sync["kind"] == "full" and b.sampler.last_sync["version"] == b.sampler.source.version
    assert b.sampler.last_sync["bytes"] == sum(p.numel() * 4 for p in b.engine.loaded.module.parameters())
    np.testing.assert_allclose(after.logprobs, forward_logprobs(b, PROMPT, after.tokens), atol=1e-3)
    assert np.abs(forward_logprobs(b, PROMPT, before.tokens) - old).max() > 1e-2  # the step changed the model


def test_seeds_temperature_top_k_and_top_p(pair):
    b, _ = pair
    seeded = {"max_tokens": 8, "seed": 5, "stop": []}
    one, again = (b.sample([PROMPT], seeded, num_samples=2)[0].sequences for _ in range(2))
    assert [s.tokens for s in one] == [s.tokens for s in again] and one[0].tokens != one[1].tokens
    assert b.sample([PROMPT], {**seeded, "seed": 6})[0].sequences[0].tokens != one[0].tokens
    greedy = b.sample([PROMPT], {"max_tokens": 8, "temperature": 0.0, "stop": []})[0].sequences[0].tokens
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}):
        assert b.sample([PROMPT], {**seeded, **narrow})[0].sequences[0].tokens == greedy, narrow
    seq = b.sample([PROMPT], {**seeded, "max_tokens": 10, "top_k": 3}, num_samples=4)[0].sequences
    for s in seq:  # every draw is among the 3 likeliest tokens at its position (ranked by the prompt scores)
        scored = b.sample([PROMPT + s.tokens], {"max_tokens": 1}, topk_prompt_logprobs=3)[0].topk_prompt_logprobs
        for i, t in enumerate(s.tokens):
            assert t in {tok for tok, _ in scored[len(PROMPT) + i]}
        np.testing.assert_allclose(s.logprobs, forward_logprobs(b, PROMPT, s.tokens), atol=1e-3)  # unfiltered


def test_prompt_logprobs_equal_the_builtin_samplers(pair, tmp_path):
    b, ref = pair
    mirror(ref, b, tmp_path / "state")
    ask = dict(num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=3)
    got = b.sample([PROMPT, [1, 2]], {"max_tokens": 2}, **ask)
    want = ref.sample([PROMPT, [1, 2]], {"max_tokens": 2}, **ask)
    for g, w in zip(got, want, strict=True):
        assert g.prompt_logprobs[0] is None and g.topk_prompt_logprobs[0] is None
        np.testing.assert_allclose(g.prompt_logprobs[1:], w.prompt_logprobs[1:], atol=1e-4)
        for gk, wk in zip(g.topk_prompt_logprobs[1:], w.topk_prompt_logprobs[1:], strict=True):
            assert [t for t, _ in gk] == [t for t, _ in wk]
            np.testing.assert_allclose([lp for _, lp in gk], [lp for _, lp in wk], atol=1e-4)


def test_a_group_prompt_is_prefilled_once(pair):
    """num_samples=8 of a 200-token prompt: vLLM computes the prompt's full blocks (128 tokens on
    CPU) once, thanks to the plugin's one-token request first, not 8 times."""
    b, _ = pair
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 250, 200)]  # not in the cache yet

    b.sample([PROMPT], {"max_tokens": 1})  # the sampler exists

    def counters():
        m = {x.name: x.value for x in b.sampler.engine.llm.get_metrics() if hasattr(x, "value")}
        return m["vllm:prompt_tokens"], m["vllm:prompt_tokens_cached"]

    tokens0, cached0 = counters()
    b.sample([prompt], {"max_tokens": 4, "seed": 1}, num_samples=8)
    tokens, cached = (a - z for a, z in zip(counters(), (tokens0, cached0), strict=True))
    block = b.sampler.engine.block_size
    assert tokens == 9 * 200  # the one-token request and the 8 samples
    assert tokens - cached == 200 + 8 * (200 - block), (tokens, cached, block)  # without the first one: 8 x 200


def test_refusals_name_the_option(pair):
    b, _ = pair
    with pytest.raises(errors.InputError, match=r"more than this vLLM engine's max_model_len 256 "
                                                 r"\(sampler_config\['max_model_len'\]\)"):
        b.sample([list(range(1, 200))], {"max_tokens": 100})
    with pytest.raises(errors.InputError, match=r"topk_prompt_logprobs=6 is more than the vllm sampler's "
                                                 r"max_logprobs 5"):
        b.sample([PROMPT], {"max_tokens": 1}, topk_prompt_logprobs=6)

    @attrs.frozen(eq=False)
    class WithNewOption(SampleRequest):  # an option a later skyrl-sdk adds, which this sampler does not know
        future_option: int = 0

    with pytest.raises(errors.InputError, match=r"the 'vllm' sampler cannot serve topk_sample_logprobs, future_option; "
                                                 r"of the options it serves sampling_params.max_tokens, "
                                                 r"sampling_params.temperature"):
        b.sampler.sample(WithNewOption(prompts=[np.array(PROMPT)], topk_sample_logprobs=2, future_option=1))
    assert b.sampler.sample(WithNewOption(prompts=[np.array(PROMPT)],
                                          sampling_params=types.SamplingParams(max_tokens=2)))[0].sequences
    # the Backend hands a prompt with images over as a ModelInput (its images read): not served here
    image = types.ModelInput([types.EncodedTextChunk([1]), types.ImageChunk(b"\x89PNG", "png", 4)])
    with pytest.raises(errors.InputError, match=r"prompt 1 holds images: the 'vllm' sampler serves token prompts "
                                                 r"only; sample a vision-language model with Backend\(sampler="):
        b.sampler.sample(SampleRequest(prompts=[np.array(PROMPT), image]))


def test_sleep_gives_the_memory_back_between_calls_on_a_gpu_and_is_refused_on_cpu():
    """sleep_level 1: vLLM drops its KV cache and moves its weights to CPU memory after each call,
    and samples the current weights again after waking. vLLM's CPU backend has no sleep mode."""
    from skyrl_sdk_vllm.loading import on_cpu

    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config={**SMALL, "sleep_level": 1}) as b:
        if on_cpu():
            with pytest.raises(errors.InputError, match=r"sleep_level'\]: vLLM's CPU backend has no sleep mode"):
                b.sample([PROMPT], {"max_tokens": 2})
            return
        for _ in range(2):
            s = b.sample([PROMPT], {"max_tokens": 8, "seed": 1})[0].sequences[0]
            assert b.sampler.engine.asleep == 1
            np.testing.assert_allclose(s.logprobs, forward_logprobs(b, PROMPT, s.tokens), atol=1e-3)
            train(b, steps=1)


@pytest.mark.parametrize("config, message", [
    ({"kv_cache_gb": 1}, r"unknown key\(s\) \['kv_cache_gb'\] for the 'vllm' sampler; did you mean 'kv_cache_gib'"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization'\]: expected a value > 0.0 and <= 1.0, got 1.5"),
    ({"engine_args": {"dtype": "half"}}, r"engine_args'\]: \['dtype'\] are set by the vllm sampler"),
    ({"max_lora_rank": 12}, r"max_lora_rank'\]: expected one of vLLM's"),
])
def test_bad_sampler_config_is_refused_by_name(config, message):
    with skyrl_sdk.Backend(model="tiny", sampler="vllm", sampler_config=config) as b:
        with pytest.raises(errors.InputError, match=message):
            b.sample([[1, 2]], {"max_tokens": 1})


def test_eos_stops_by_default_and_not_with_an_empty_stop_list(pair, tmp_path):
    """Make EOS (257) the likeliest token after the prompt: stop=None ends there, stop=[] does not.
    (Last in the module: the training makes EOS likely after any prompt.)"""
    b, ref = pair
    eos_prompt = [3, 4, 5, 6]
    data = [types.Datum(model_input=types.ModelInput.from_ints(eos_prompt), loss_fn_inputs={"target_tokens": [4, 5, 6, 257]})]
    for _ in range(25):
        b.forward_backward(data, "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=5e-2))
    mirror(ref, b, tmp_path / "state")
    stopped = b.sample([eos_prompt], GREEDY)[0].sequences[0]
    assert stopped.tokens == [257] and stopped.stop_reason == "stop"
    running = b.sample([eos_prompt], {**GREEDY, "stop": []})[0].sequences[0]
    assert running.tokens[0] == 257 and len(running.tokens) == 12 and running.stop_reason == "length"
    assert running.tokens == ref.sample([eos_prompt], {**GREEDY, "stop": []})[0].sequences[0].tokens
