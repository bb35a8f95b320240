"""Top-k prompt logprobs through ``skyrl-sdk serve`` and the unmodified ``tinker`` client,
checked against :meth:`Backend.sample` in process (same model, same seed)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from _limits import HANG_S
from _server_harness import ServerThread, raw_client, wait_result
from skyrl_sdk import Backend, types
from skyrl_sdk.server.wire.envelopes import MAX_TOPK_PROMPT_LOGPROBS
from skyrl_sdk.server.wire.proto import TOPK_EMPTY_LOGPROB, sample_output_to_proto

PROMPT = [72, 101, 108, 108, 111, 32, 119]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as server:
        yield server


@pytest.fixture(scope="module")
def sampler(srv):
    service = srv.service_client()
    yield service.create_sampling_client(base_model="tiny").result()
    service.close("success").result()


@pytest.fixture(scope="module")
def reference():
    with Backend(model="tiny") as b:
        yield b


def assert_topk_equal(got, want):
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        np.testing.assert_allclose([lp for _, lp in g], [lp for _, lp in w], atol=1e-5)


@pytest.mark.parametrize("k", [1, 5])
def test_topk_prompt_logprobs_match_backend(sampler, reference, k):
    params = tt.SamplingParams(max_tokens=5, seed=4, temperature=1.0)
    got = sampler.sample(tt.ModelInput.from_ints(PROMPT), 2, params, include_prompt_logprobs=True,
                         topk_prompt_logprobs=k).result(timeout=HANG_S)
    want = reference.sample([PROMPT], {"max_tokens": 5, "seed": 4, "temperature": 1.0}, 2,
                            prompt_logprobs=True, topk_prompt_logprobs=k)[0]
    assert_topk_equal(got.topk_prompt_logprobs, want.topk_prompt_logprobs)
    assert all(len(row) == k for row in got.topk_prompt_logprobs[1:])
    np.testing.assert_allclose(np.array(got.prompt_logprobs[1:], dtype=np.float32),
                               np.array(want.prompt_logprobs[1:], dtype=np.float32), atol=1e-5)
    # the samples are unchanged by asking for top-k
    assert [list(s.tokens) for s in got.sequences] == [list(s.tokens) for s in want.sequences]
    # ranked: most likely first, and the prompt's own token is scored consistently
    for row in got.topk_prompt_logprobs[1:]:
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)


def test_topk_without_prompt_logprobs_and_last_n(sampler, reference):
    prompt = tt.ModelInput.from_ints(PROMPT)
    params = tt.SamplingParams(max_tokens=1, temperature=0.0)
    want = reference.sample([PROMPT], {"max_tokens": 1, "temperature": 0.0}, 1,
                            topk_prompt_logprobs=3)[0].topk_prompt_logprobs
    alone = sampler.sample(prompt, 1, params, topk_prompt_logprobs=3).result(timeout=HANG_S)
    assert alone.prompt_logprobs is None
    assert_topk_equal(alone.topk_prompt_logprobs, want)
    # prompt_logprobs_last_n applies to the top-k rows too: earlier rows are None
    last = sampler.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3,
                          prompt_logprobs_last_n=2).result(timeout=HANG_S)
    assert last.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert_topk_equal([None] + last.topk_prompt_logprobs[-2:], [None] + want[-2:])
    assert last.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    # not asked: absent
    plain = sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result(timeout=HANG_S)
    assert plain.topk_prompt_logprobs is None


def test_topk_one_token_prompt_is_a_single_empty_row(sampler):
    res = sampler.sample(tt.ModelInput.from_ints([5]), 1, tt.SamplingParams(max_tokens=1),
                         topk_prompt_logprobs=4).result(timeout=HANG_S)
    assert res.topk_prompt_logprobs == [None]


def test_concurrent_requests_with_different_k_are_not_mixed(sampler, reference):
    """Requests differing only in k go to different batches (k is in the batching key)."""
    params = tt.SamplingParams(max_tokens=2)
    futures = [(k, sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, params, topk_prompt_logprobs=k))
               for k in (0, 2, 4, 2, 6)]
    for k, f in futures:
        res = f.result(timeout=HANG_S)
        if k == 0:
            assert res.topk_prompt_logprobs is None
        else:
            assert [len(r) for r in res.topk_prompt_logprobs[1:]] == [k] * (len(PROMPT) - 1)


def test_too_wide_topk_through_the_client_is_a_user_error(sampler):
    with pytest.raises(tinker.RequestFailedError, match=f"topk_prompt_logprobs.*0..{MAX_TOPK_PROMPT_LOGPROBS}"):
        sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=2),
                       topk_prompt_logprobs=MAX_TOPK_PROMPT_LOGPROBS + 1).result(timeout=HANG_S)


@pytest.mark.parametrize("bad", [-1, MAX_TOPK_PROMPT_LOGPROBS + 1, 2.0, True, "3", [2]])
def test_bad_topk_fails_before_any_work_naming_the_field(srv, bad):
    with raw_client(srv) as http:
        answer = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": PROMPT, "num_samples": 2,
                                                    "topk_prompt_logprobs": bad}).json()
        assert answer["sample_sequence_ids"] == []  # refused before any sample id was handed out
        doc = wait_result(http, answer["request_id"]).json()
    assert doc["category"] == "user"
    assert doc["error"] == f"topk_prompt_logprobs: expected an integer in 0..{MAX_TOPK_PROMPT_LOGPROBS}, got {bad!r}"


def test_topk_wire_layout_is_tinkers():
    """Encoded as Tinker's dense n x k TopkLogprobs: row-major, empty cells (0, -99999)."""
    out = types.SampleOutput(sequences=[], topk_prompt_logprobs=[None, [(3, -0.5), (9, -1.5)], [(4, -0.25)]])
    msg = pb.SampleResponse()
    msg.ParseFromString(sample_output_to_proto(out, topk=2))
    t = msg.topk_prompt_logprobs
    assert (t.length, t.k) == (3, 2)
    np.testing.assert_array_equal(np.frombuffer(t.token_ids, np.int32).reshape(3, 2), [[0, 0], [3, 9], [4, 0]])
    np.testing.assert_array_equal(np.frombuffer(t.logprobs, np.float32).reshape(3, 2),
                                  [[TOPK_EMPTY_LOGPROB] * 2, [-0.5, -1.5], [-0.25, TOPK_EMPTY_LOGPROB]])
    from tinker.proto.response_conv import deserialize_sample_response

    assert deserialize_sample_response(msg.SerializeToString()).topk_prompt_logprobs == \
        [None, [(3, -0.5), (9, -1.5)], [(4, -0.25)]]
