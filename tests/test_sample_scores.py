"""Tinker's other sampling scores in process: topk_sample_logprobs, target_prompt_logprobs and
prompt_alt_tokens_k, each against ``forward`` (an independent computation of the same
distributions), and refused by name where a sampler cannot serve them."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import Backend
from skyrl_sdk.errors import InputError
from skyrl_sdk.types import Datum, ModelInput

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def backend():
    with Backend(model="tiny", seed=0) as b:
        yield b


def forward_topk(backend, tokens, targets):
    """``forward``'s logprobs of ``targets`` (rows x K token ids) after each prefix of ``tokens``."""
    datum = Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs={"target_tokens": np.asarray(targets)})
    return backend.forward([datum], "cross_entropy").loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_topk_sample_logprobs_are_the_sampled_positions_distributions(backend, temperature):
    out = backend.sample([PROMPT], {"max_tokens": 5, "seed": 2, "temperature": temperature}, num_samples=2,
                         topk_sample_logprobs=4)[0]
    for seq in out.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens)
        ids = np.array([[t for t, _ in row] for row in seq.topk_logprobs])
        lps = np.array([[lp for _, lp in row] for row in seq.topk_logprobs])
        assert ids.shape == (len(seq.tokens), 4) and (np.diff(lps, axis=1) <= 0).all()
        full = PROMPT + seq.tokens
        ref = forward_topk(backend, full[:-1], np.concatenate([np.zeros((len(PROMPT) - 1, 4), np.int64), ids]))
        np.testing.assert_allclose(lps, ref[len(PROMPT) - 1:], atol=1e-5)
        # the top-4 are the 4 largest of the whole distribution: nothing above the 4th
        assert (np.asarray(seq.logprobs) <= lps[:, 0] + 1e-6).all()
        if temperature == 0.0:
            assert ids[:, 0].tolist() == seq.tokens


def test_target_prompt_logprobs_score_the_named_ids(backend):
    ids = -np.ones((len(PROMPT) - 1, 3), dtype=np.int64)
    ids[1] = [7, 0, 300]
    ids[3, 2] = 10
    ids[4, 0] = 11
    out = backend.sample([PROMPT, PROMPT[:3]], {"max_tokens": 1}, target_prompt_logprobs=[ids, None])
    got = out[0].target_prompt_logprobs
    ref = forward_topk(backend, PROMPT[:-1], np.clip(ids, 0, None))
    np.testing.assert_allclose(got[ids >= 0], ref[ids >= 0], atol=1e-5)
    assert (got[ids < 0] == 0.0).all() and got.dtype == np.float32
    assert out[1].target_prompt_logprobs is None


def test_prompt_alt_tokens_are_draws_with_their_logprobs(backend):
    out = backend.sample([PROMPT], {"max_tokens": 1, "seed": 5}, prompt_alt_tokens_k=6)[0]
    alt = out.prompt_alt_tokens
    assert alt.tokens.shape == alt.logprobs.shape == (len(PROMPT) - 1, 6)
    np.testing.assert_allclose(alt.logprobs, forward_topk(backend, PROMPT[:-1], alt.tokens), atol=1e-5)
    again = backend.sample([PROMPT], {"max_tokens": 1, "seed": 5}, prompt_alt_tokens_k=6)[0].prompt_alt_tokens
    assert (again.tokens == alt.tokens).all()  # the request's seed
    greedy = backend.sample([PROMPT], {"max_tokens": 1, "temperature": 0.0}, prompt_alt_tokens_k=3)[0]
    argmax = [int(np.argmax(forward_topk(backend, PROMPT[:-1], np.tile(np.arange(backend.vocab_size), (5, 1)))[i]))
              for i in range(len(PROMPT) - 1)]
    assert greedy.prompt_alt_tokens.tokens.tolist() == [[a] * 3 for a in argmax]


def test_prompt_alt_tokens_follow_the_distribution(backend):
    """20,000 draws at one position against the model's probabilities (chi-square, 319
    degrees of freedom: mean 319, sd 25; a wrong distribution lands in the thousands)."""
    vocab = backend.vocab_size
    out = backend.sample([PROMPT[:2]], {"max_tokens": 1, "seed": 11}, prompt_alt_tokens_k=20_000)[0]
    counts = np.bincount(out.prompt_alt_tokens.tokens[0], minlength=vocab)
    probs = np.exp(forward_topk(backend, PROMPT[:1], np.arange(vocab)[None, :])[0].astype(np.float64))
    expected = 20_000 * probs / probs.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 319 + 6 * 25


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_sample_logprobs=-1), "topk_sample_logprobs: expected an integer"),
    (dict(prompt_alt_tokens_k=1.5), "prompt_alt_tokens_k: expected an integer"),
    (dict(target_prompt_logprobs=[np.zeros((2, 1), np.int64)]), r"expected shape \[len\(prompt\) - 1, K\] = \[5, K\]"),
    (dict(target_prompt_logprobs=[np.full((5, 1), -1)]), "names no token id"),
    (dict(target_prompt_logprobs=[np.full((5, 1), 999)]), r"\[0, 0\]: token id 999 is outside the vocabulary"),
    (dict(target_prompt_logprobs=np.zeros((5, 1), np.int64)), "one entry per prompt"),
])
def test_bad_scores_are_refused_by_name(backend, kwargs, match):
    with pytest.raises(InputError, match=match):
        backend.sample([PROMPT], {"max_tokens": 1}, **kwargs)


def test_a_sampler_that_does_not_serve_a_score_refuses_it_by_name(fresh_plugins):
    from skyrl_sdk.sampling import Sampler

    @skyrl_sdk.register_sampler("plain_only", description="serves samples, no other scores")
    class PlainOnly(Sampler):
        name = "plain_only"

        def sample(self, request):
            self.refuse(request, supported=("sampling_params.max_tokens",))
            return self.source.decoder().generate(request)

    with Backend(model="tiny", sampler="plain_only") as b:
        assert len(b.sample([PROMPT], {"max_tokens": 2})[0].sequences) == 1  # the rest still works
        for name, value in (("topk_sample_logprobs", 2), ("prompt_alt_tokens_k", 1),
                            ("target_prompt_logprobs", [np.full((len(PROMPT) - 1, 1), 3)])):
            with pytest.raises(InputError, match=f"^the 'plain_only' sampler cannot serve {name};"):
                b.sample([PROMPT], {"max_tokens": 2}, **{name: value})
