"""Tinker's other sampling scores through ``skyrl-sdk serve`` and the unmodified client
(topk_sample_logprobs, target_prompt_logprobs dense and sparse, prompt_alt_tokens_k), equal
to :meth:`Backend.sample` in process with the same model and seed: the same decision and the
same numbers on both paths. And record_stability_info's sequence ids."""

from __future__ import annotations

import re

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
import torch
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, raw_client, wait_result
from skyrl_sdk import Backend

PROMPT = [72, 101, 108, 108, 111, 32, 119]
PARAMS = {"max_tokens": 4, "seed": 9, "temperature": 1.0}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as server:
        yield server


@pytest.fixture(scope="module")
def service(srv):
    service = srv.service_client()
    yield service
    service.close("success").result()


@pytest.fixture(scope="module")
def sampler(service):
    return service.create_sampling_client(base_model="tiny").result()


@pytest.fixture(scope="module")
def reference():
    with Backend(model="tiny") as b:
        yield b


def _target_ids() -> np.ndarray:
    ids = -np.ones((len(PROMPT) - 1, 3), dtype=np.int64)
    ids[2] = [5, 108, 200]
    ids[5, 1] = 119
    return ids


@pytest.mark.parametrize("sparse", [False, True])
def test_scores_over_http_equal_the_backend(sampler, reference, sparse):
    ids = _target_ids()
    target = tt.TensorData.from_torch_sparse(torch.tensor(ids), pad_value=-1) if sparse \
        else tt.TensorData.from_numpy(ids)
    assert (target.sparse_crow_indices is not None) == sparse
    got = sampler.sample(tt.ModelInput.from_ints(PROMPT), 2, tt.SamplingParams(**PARAMS), topk_sample_logprobs=3,
                         target_prompt_logprobs=target, prompt_alt_tokens_k=4).result(timeout=HANG_S)
    want = reference.sample([PROMPT], PARAMS, 2, topk_sample_logprobs=3, target_prompt_logprobs=[ids],
                            prompt_alt_tokens_k=4)[0]
    for g, w in zip(got.sequences, want.sequences, strict=True):
        assert list(g.tokens) == w.tokens
        assert [[t for t, _ in row] for row in g.topk_logprobs] == [[t for t, _ in row] for row in w.topk_logprobs]
        np.testing.assert_allclose([[lp for _, lp in row] for row in g.topk_logprobs],
                                   [[lp for _, lp in row] for row in w.topk_logprobs], atol=1e-5)
    np.testing.assert_allclose(got.target_prompt_logprobs.to_numpy(), want.target_prompt_logprobs, atol=1e-5)
    assert (got.target_prompt_logprobs.to_numpy()[ids < 0] == 0).all()
    assert got.prompt_alt_tokens.tokens.to_numpy().tolist() == want.prompt_alt_tokens.tokens.tolist()
    np.testing.assert_allclose(got.prompt_alt_tokens.logprobs.to_numpy(), want.prompt_alt_tokens.logprobs, atol=1e-5)


@pytest.mark.parametrize("field,value,match", [
    ("topk_sample_logprobs", 21, "topk_sample_logprobs: expected an integer in 0..20, got 21"),
    ("prompt_alt_tokens_k", 21, "prompt_alt_tokens_k: expected an integer in 0..20, got 21"),
])
def test_widths_are_bounded_by_name(sampler, field, value, match):
    with pytest.raises(tinker.RequestFailedError, match=match):
        sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=1),
                       **{field: value}).result(timeout=HANG_S)


def test_a_target_id_outside_the_vocabulary_is_refused(sampler):
    ids = _target_ids()
    ids[0, 0] = 10**6
    with pytest.raises(tinker.RequestFailedError, match=r"target_prompt_logprobs\[0, 0\]: token id 1000000 is outside"):
        sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=1),
                       target_prompt_logprobs=tt.TensorData.from_numpy(ids)).result(timeout=HANG_S)


def test_recorded_samples_get_their_ids_and_ad_hoc_ones_are_refused(srv, service):
    recording = service.create_sampling_client(base_model="tiny", record_stability_info=True).result()
    out = recording.sample(tt.ModelInput.from_ints(PROMPT), 3, tt.SamplingParams(max_tokens=3)).result(timeout=HANG_S)
    ids = [s.sequence_id for s in out.sequences]
    assert len(set(ids)) == 3
    # the one id format, in process too (tests/test_sample_request.py): the request's id and the index
    assert [re.fullmatch(r"sample-[0-9a-f]{32}:(\d)", i).group(1) for i in ids] == ["0", "1", "2"]
    assert len({i.split(":")[0] for i in ids}) == 1
    records = srv.runtime.recorded.sessions[service.holder.get_session_id()]
    used = records.use(ids)
    assert [used[i].tokens.tolist() for i in ids] == [list(s.tokens) for s in out.sequences]
    assert used[ids[0]].prompt.tolist() == PROMPT
    np.testing.assert_array_equal(used[ids[1]].logprobs, np.asarray(out.sequences[1].logprobs, np.float32))
    # an ad-hoc sample (no sampling session) belongs to no session: refused, not silently unrecorded
    with raw_client(srv) as http:
        future = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                                    "sampling_params": {"max_tokens": 1},
                                                    "record_stability_info": True}).json()
        answer = wait_result(http, future["request_id"]).json()
    assert answer["category"] == "user" and "record_stability_info: recorded sequences belong to a session" \
        in answer["error"]
