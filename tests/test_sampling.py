"""Sampling: logprobs agree with forward (fp32 and bf16), seeds reproduce without touching the
global RNG, Tinker's stop rules, prompt and top-k prompt logprobs, early-stopping rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.sampling import generate


@pytest.fixture(scope="module")
def backend():
    with skyrl_sdk.Backend(seed=0) as b:
        yield b


def _forward_logprobs(backend, prompts, outs) -> list[tuple[np.ndarray, np.ndarray]]:
    """(sampler logprobs, forward logprobs) per sequence."""
    data, sampled = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        for seq in out.sequences:
            full = list(prompt) + seq.tokens
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:]}))
            sampled.append((len(prompt), np.array(seq.logprobs)))
    fwd = backend.forward(data)
    return [(lps, o["logprobs"].to_numpy()[n - 1:]) for (n, lps), o in zip(sampled, fwd.loss_fn_outputs, strict=True)]


def _direct(backend, prompts, params, num_samples=1, eos=None, **kw):
    """``generate`` on the backend's model with a chosen EOS id (the engine's is fixed)."""
    eng = backend.engine
    request = types.SampleRequest(prompts=[np.asarray(p, dtype=np.int64) for p in prompts], sampling_params=params,
                                  num_samples=num_samples, **kw)
    return generate(eng.loaded.module, eng.tokenizer, request, device=eng.device, eos_token_id=eos,
                    pad_token_id=eng.runner.pad_id)


# ---- parity with forward -------------------------------------------------------------------
def test_sampled_logprobs_agree_with_forward(backend):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [50, 60], [9]]  # different lengths: left padding in the prefill
    outs = backend.sample(prompts, types.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[]),
                          num_samples=3)
    assert [len(o.sequences) for o in outs] == [3, 3, 3]
    assert all(len(s.tokens) == 12 and s.stop_reason == "length" for o in outs for s in o.sequences)
    for sampled, forward in _forward_logprobs(backend, prompts, outs):
        np.testing.assert_allclose(sampled, forward, atol=1e-4)


@pytest.mark.parametrize("master_dtype", ["bfloat16", "float32"], ids=["pure_bf16", "bf16_mixed"])
def test_bf16_logprobs_agree_with_forward(master_dtype):
    cfg = {"dtype": "bfloat16", "master_dtype": master_dtype}
    with skyrl_sdk.Backend(seed=0, engine_config=cfg) as b:
        assert next(b.engine.loaded.module.parameters()).dtype == getattr(torch, master_dtype)
        prompts = [[1, 2, 3, 4, 5, 6, 7], [50, 60]]
        outs = b.sample(prompts, types.SamplingParams(max_tokens=10, seed=5, stop=[]), num_samples=2,
                        prompt_logprobs=True)
        for sampled, forward in _forward_logprobs(b, prompts, outs):
            np.testing.assert_allclose(sampled, forward, atol=1e-3)
        fwd = b.forward([types.Datum(model_input=types.ModelInput.from_ints(prompts[0][:-1]),
                                     loss_fn_inputs={"target_tokens": prompts[0][1:]})])
        np.testing.assert_allclose(outs[0].prompt_logprobs[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                   atol=1e-3)


def test_logprobs_are_the_models_whatever_the_temperature_and_filters(backend):
    """Tinker's sampler reports the model's logprob (temperature 1, unfiltered), as forward does."""
    prompts = [[4, 8, 15, 16]]
    params = types.SamplingParams(max_tokens=10, temperature=0.7, top_k=20, top_p=0.9, seed=2, stop=[])
    outs = backend.sample(prompts, params, num_samples=2)
    for sampled, forward in _forward_logprobs(backend, prompts, outs):
        np.testing.assert_allclose(sampled, forward, atol=1e-4)


# ---- seeds ---------------------------------------------------------------------------------
def test_seed_reproduces_and_leaves_the_global_rng_alone(backend):
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    state = torch.get_rng_state()
    a = backend.sample([[5, 6, 7], [1]], params, num_samples=2)
    b = backend.sample([[5, 6, 7], [1]], params, num_samples=2)
    backend.sample([[5, 6, 7]], types.SamplingParams(max_tokens=4))  # unseeded: its own entropy
    assert torch.equal(torch.get_rng_state(), state)
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b]
    assert a[0].sequences[0].tokens != a[0].sequences[1].tokens  # samples of one prompt differ
    other = backend.sample([[5, 6, 7], [1]], types.SamplingParams(max_tokens=16, seed=12), num_samples=2)
    assert [s.tokens for s in other[0].sequences] != [s.tokens for s in a[0].sequences]


# ---- stop rules ----------------------------------------------------------------------------
def _greedy(backend, prompt, n=12):
    return _direct(backend, [prompt], types.SamplingParams(max_tokens=n, temperature=0.0, stop=[]))[0].sequences[0]


def test_default_stop_is_eos_and_empty_stop_disables_it(backend):
    prompt = [10, 11, 12]
    g = _greedy(backend, prompt).tokens
    eos = g[2]
    cut = g.index(eos) + 1
    by_default = _direct(backend, [prompt], types.SamplingParams(max_tokens=12, temperature=0.0), eos=eos)
    assert by_default[0].sequences[0].tokens == g[:cut] and by_default[0].sequences[0].stop_reason == "stop"
    never = _direct(backend, [prompt], types.SamplingParams(max_tokens=12, temperature=0.0, stop=[]), eos=eos)
    assert never[0].sequences[0].tokens == g and never[0].sequences[0].stop_reason == "length"
    assert types.SamplingParams().stop is None and types.SamplingParams(stop=[]).stop == ()


def test_stop_list_replaces_eos(backend):
    prompt = [10, 11, 12]
    g = _greedy(backend, prompt).tokens
    eos, stop = g[1], g[4]
    out = _direct(backend, [prompt], types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]), eos=eos)
    seq = out[0].sequences[0]
    assert seq.tokens == g[:g.index(stop) + 1] and seq.stop_reason == "stop"
    with_eos = _direct(backend, [prompt], types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop, eos]),
                       eos=eos)
    first = min(g.index(stop), g.index(eos)) + 1
    assert with_eos[0].sequences[0].tokens == g[:first]


def test_stop_string_cuts_after_the_token_that_completes_it(backend):
    prompt = [10, 11, 12]
    g = _greedy(backend, prompt, 16).tokens
    tok = backend.tokenizer
    target = next(i for i in range(3, 16) if tok.decode(g[:i]).strip())
    text = tok.decode(g[:target])
    stop = text[-1]
    expected = next(i for i in range(1, 17) if stop in tok.decode(g[:i]))  # brute force over prefixes
    seq = backend.sample([prompt], types.SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))[0].sequences[0]
    assert seq.tokens == g[:expected] and seq.stop_reason == "stop"


def test_stop_strings_need_a_tokenizer(backend):
    with pytest.raises(errors.InputError, match="SamplingParams.stop: stop strings need a tokenizer"):
        generate(backend.engine.loaded.module, None,
                 types.SampleRequest(prompts=[np.array([1, 2])], sampling_params=types.SamplingParams(stop=["x"])),
                 device=backend.engine.device, eos_token_id=None, pad_token_id=0)


def test_rows_that_stop_early_leave_the_batch_without_changing_the_others(backend):
    """Greedy rows are deterministic: batched (with rows dropping out) equals one at a time."""
    prompts = [[10, 11, 12], [3, 1, 4, 1, 5], [200], [7, 7]]
    singles = [_greedy(backend, p, 20).tokens for p in prompts]
    eos = singles[0][1]  # ends row 0 early; others stop wherever they meet it, or run to the end
    params = types.SamplingParams(max_tokens=20, temperature=0.0)
    batched = _direct(backend, prompts, params, num_samples=2, eos=eos)
    for single, out in zip(singles, batched, strict=True):
        expected = single[:single.index(eos) + 1] if eos in single else single
        for seq in out.sequences:
            assert seq.tokens == expected
            assert seq.stop_reason == ("stop" if eos in single else "length")
    assert len(batched[0].sequences[0].tokens) == 2


# ---- prompt logprobs -----------------------------------------------------------------------
def test_prompt_logprobs_match_forward(backend):
    prompt = [3, 9, 27, 81, 243]
    out = backend.sample([prompt], types.SamplingParams(max_tokens=1), prompt_logprobs=True)[0]
    fwd = backend.forward([types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                                       loss_fn_inputs={"target_tokens": prompt[1:]})])
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
    assert out.topk_prompt_logprobs is None


def test_topk_prompt_logprobs_match_an_independent_reference(backend):
    prompts = [[3, 9, 27, 81, 243], [7, 1]]
    outs = backend.sample(prompts, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=3, prompt_logprobs=True)
    module = backend.engine.loaded.module
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = module(input_ids=torch.tensor([prompt]), use_cache=False).logits[0, :-1].double()
        ref = torch.log_softmax(logits, dim=-1).topk(3, dim=-1)
        topk = out.topk_prompt_logprobs
        assert len(topk) == len(prompt) and topk[0] is None and out.prompt_logprobs[0] is None
        for i, pairs in enumerate(topk[1:]):
            assert [t for t, _ in pairs] == ref.indices[i].tolist()
            np.testing.assert_allclose([lp for _, lp in pairs], ref.values[i].numpy(), atol=1e-4)
            if prompt[i + 1] in dict(pairs):  # the prompt token's own logprob is consistent
                assert dict(pairs)[prompt[i + 1]] == pytest.approx(out.prompt_logprobs[i + 1], abs=1e-5)


def test_topk_larger_than_the_vocabulary_returns_it_all(backend):
    out = backend.sample([[1, 2]], types.SamplingParams(max_tokens=1), topk_prompt_logprobs=10_000)[0]
    assert len(out.topk_prompt_logprobs[1]) == backend.vocab_size
    assert np.exp([lp for _, lp in out.topk_prompt_logprobs[1]]).sum() == pytest.approx(1.0, abs=1e-4)


# ---- bad input -----------------------------------------------------------------------------
def test_bad_input_is_rejected(backend):
    with pytest.raises(errors.InputError, match=r"prompt 1: token ids must be in \[0, 320\).*got 999"):
        backend.sample([[1, 2], [999]], types.SamplingParams())
    with pytest.raises(errors.InputError, match="top_p"):
        types.SamplingParams(top_p=0.0)
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(errors.InputError, match="topk_prompt_logprobs: expected an integer >= 0"):
            backend.sample([[1, 2]], types.SamplingParams(), topk_prompt_logprobs=bad)
