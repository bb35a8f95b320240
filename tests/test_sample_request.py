"""One sample call is one ``SampleRequest`` from the caller to the decode loop: built once (in
process or from Tinker's JSON), checked however it is built, handed on unchanged, batched by a
key derived from its fields, and recorded one way with one sequence-id format."""

from __future__ import annotations

import inspect
import re

import attrs
import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.engines.plain import sample_request_from_plain, sample_request_to_plain
from skyrl_sdk.errors import InputError
from skyrl_sdk.inputs.sample import OPTION_KEYS, sample_request_from_any
from skyrl_sdk.sampling import decode
from skyrl_sdk.server.compute.sampling import batch_key
from skyrl_sdk.server.wire import envelopes
from skyrl_sdk.types import SampleRequest, SamplingParams

PROMPT = np.array([5, 6, 7, 8], dtype=np.int64)

#: For every option of a request, values that change what a sampler returns (the samples or the
#: scores). Written out here, independently of the code: a field the code leaves out of the batch
#: key fails below; a new field fails until it is listed here or among the mergeable ones.
CHANGES_RESULTS = {
    "sampling_params": [SamplingParams(max_tokens=3), SamplingParams(temperature=0.5), SamplingParams(top_k=3),
                        SamplingParams(top_p=0.5), SamplingParams(stop=["x"]), SamplingParams(stop=[])],
    "num_samples": [2],
    "prompt_logprobs": [True],
    "topk_prompt_logprobs": [2],
    "topk_sample_logprobs": [2],
    "prompt_alt_tokens_k": [2],
}
#: The fields requests of one batch may differ in: one entry per prompt, concatenated by the
#: batch, or served for each request by the caller (recording), changing no sample.
MERGEABLE = {"prompts", "target_prompt_logprobs", "record_stability_info"}


def _request(**fields) -> SampleRequest:
    return SampleRequest(prompts=[PROMPT], **fields)


def test_every_field_that_changes_results_is_in_the_servers_batch_key():
    """The server runs queued requests with equal keys as one sampler call, with the first
    one's options: a field left out of the key would give a request another's settings."""
    names = [f.name for f in attrs.fields(SampleRequest)]
    unlisted = [n for n in names if n not in MERGEABLE and n not in CHANGES_RESULTS]
    assert not unlisted, f"new fields {unlisted}: list the values that change results in CHANGES_RESULTS"
    plain = _request()
    for name, values in CHANGES_RESULTS.items():
        for value in values:
            other = attrs.evolve(plain, **{name: value})
            assert batch_key("target", None, other) != batch_key("target", None, plain), (name, value)
    # the same options batch together, whatever the prompts, their target ids and recording
    merged = SampleRequest(prompts=[np.array([1, 2, 3])], record_stability_info=True,
                           target_prompt_logprobs=[np.array([[1], [-1]])])
    assert batch_key("target", None, merged) == batch_key("target", None, plain)
    # another sampler, another pinned weights version: never one call
    assert batch_key("other", None, plain) != batch_key("target", None, plain)
    assert batch_key("target", 3, plain) != batch_key("target", None, plain)
    # a seeded request draws from its own generator, an image prompt is read in its own call: alone
    assert batch_key("target", None, _request(sampling_params=SamplingParams(seed=1))) is None
    assert batch_key("target", None, SampleRequest(prompts=[_image_prompt()])) is None


def test_a_batch_concatenates_the_per_prompt_fields_and_keeps_every_option():
    options = dict(sampling_params=SamplingParams(max_tokens=2, top_k=3), num_samples=2, topk_sample_logprobs=1)
    a = SampleRequest(prompts=[PROMPT], **options)
    b = SampleRequest(prompts=[np.array([1, 2, 3]), np.array([9, 9])], record_stability_info=True,
                      target_prompt_logprobs=[np.array([[1], [-1]]), None], **options)
    batch = SampleRequest.batched([a, b])
    assert [p.tolist() for p in batch.prompts] == [PROMPT.tolist(), [1, 2, 3], [9, 9]]
    assert batch.target_prompt_logprobs[0] is None and batch.target_prompt_logprobs[2] is None
    assert batch.target_prompt_logprobs[1].tolist() == [[1], [-1]]
    assert batch.record_stability_info is False  # recorded for each request by whoever batched them
    assert batch.batch_key() == a.batch_key()
    assert SampleRequest.batched([a, a]).target_prompt_logprobs is None
    with pytest.raises(ValueError, match="differ in an option"):
        SampleRequest.batched([a, attrs.evolve(a, num_samples=3)])


def test_the_request_is_keyword_only_and_checks_itself_however_built():
    with pytest.raises(TypeError):
        SampleRequest([PROMPT], SamplingParams())  # the positional form is refused
    with pytest.raises(InputError, match=r"num_samples: expected an integer >= 1, got 0"):
        _request(num_samples=0)
    with pytest.raises(InputError, match=r"prompt_logprobs: expected true or false, got 1"):
        _request(prompt_logprobs=1)
    with pytest.raises(InputError, match=r"prompt 0: expected a 1-D int64 array of token ids"):
        SampleRequest(prompts=[[1, 2]])
    with pytest.raises(InputError, match=r"target_prompt_logprobs: expected shape \[len\(prompt\) - 1, K\] = \[3, K\]"):
        _request(target_prompt_logprobs=[np.array([[1]])])
    with pytest.raises(InputError, match=r"every entry is None"):
        _request(target_prompt_logprobs=[None])


def test_the_options_are_the_requests_fields_everywhere():
    """Backend.sample's keyword arguments, the JSON keys the server reads and what the FSDP ranks
    receive are the request's fields: a new field is a new option on every path."""
    assert list(inspect.signature(skyrl_sdk.Backend.sample).parameters)[1:] == ["prompts", *OPTION_KEYS]
    assert set(OPTION_KEYS) <= set(envelopes.REQUEST_KEYS["asample"])
    request = SampleRequest(prompts=[PROMPT, np.array([1, 2])], sampling_params=SamplingParams(max_tokens=2, stop=[3]),
                            num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=1, topk_sample_logprobs=2,
                            target_prompt_logprobs=[None, np.array([[0, -1]])], prompt_alt_tokens_k=1)
    back = sample_request_from_plain(sample_request_to_plain(request))
    for f in attrs.fields(SampleRequest):
        if f.name in ("prompts", "target_prompt_logprobs"):
            assert [None if a is None else a.tolist() for a in getattr(back, f.name)] == \
                [None if a is None else a.tolist() for a in getattr(request, f.name)]
        else:
            assert getattr(back, f.name) == getattr(request, f.name), f.name


def test_the_callers_request_reaches_the_sampler_and_the_decode_loop_unchanged(tiny_backend, monkeypatch):
    seen = []
    real = decode.generate

    def spy(module, tokenizer, request, **kw):
        seen.append(request)
        return real(module, tokenizer, request, **kw)

    monkeypatch.setattr(decode, "generate", spy)
    request = sample_request_from_any([[5, 6, 7]], {"max_tokens": 2}, num_samples=2, topk_sample_logprobs=1)
    out = tiny_backend.sample_request(request)
    assert seen == [request] and seen[0] is request
    assert len(out[0].sequences) == 2 and len(out[0].sequences[0].topk_logprobs[0]) == 1


# ---- images: what a prompt with images cannot ask for -------------------------------------------
def _image_prompt() -> types.ModelInput:
    return types.ModelInput([types.EncodedTextChunk(np.array([1, 2])), types.ImageChunk(b"\x89PNG", "png", 4)])


IMAGE_REFUSALS = [
    ({"record_stability_info": True}, r"^record_stability_info: not available for a prompt with images$"),
    ({"prompt_alt_tokens_k": 2}, r"^prompt_alt_tokens_k: not available for a prompt with images$"),
    ({"target_prompt_logprobs": [np.array([[1]] * 5)]},
     r"^target_prompt_logprobs: not available for a prompt with images"),
]


@pytest.mark.parametrize("options, match", IMAGE_REFUSALS)
def test_a_prompt_with_images_refuses_what_needs_its_positions_on_every_path(options, match):
    """Recording, alternative draws and target ids need the prompt's positions, known only once
    the image processor has read it: refused by name, in process, from JSON and however the
    request is built."""
    with pytest.raises(InputError, match=match):
        sample_request_from_any([_image_prompt()], **options)
    with pytest.raises(InputError, match=match):
        SampleRequest(prompts=[_image_prompt()], **options)
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]},
                                  {"type": "image", "data": "iVBORw==", "format": "png", "expected_tokens": 4}]},
            **{k: v for k, v in options.items() if k != "target_prompt_logprobs"}}
    if "target_prompt_logprobs" in options:
        body["target_prompt_logprobs"] = {"data": [1] * 5, "dtype": "int64", "shape": [5, 1]}
    with pytest.raises(InputError, match=match):
        envelopes.parse_sample_request(body, 8)
    assert SampleRequest(prompts=[_image_prompt()]).options_set() == []  # the prompt alone is fine


# ---- recording: one path, one id format ---------------------------------------------------------
#: a sequence's id: its request's id (``sample-`` and 32 hex digits, as the server's futures) and its index
SEQUENCE_ID = re.compile(r"^(sample-[0-9a-f]{32}):(\d+)$")


def test_recorded_sequences_carry_the_servers_id_format(tiny_backend):
    outs = tiny_backend.sample([[5, 6, 7], [8, 9]], {"max_tokens": 2}, num_samples=2, record_stability_info=True)
    ids = [[SEQUENCE_ID.match(s.sequence_id) for s in out.sequences] for out in outs]
    assert all(m is not None for row in ids for m in row), [s.sequence_id for o in outs for s in o.sequences]
    assert [[int(m.group(2)) for m in row] for row in ids] == [[0, 1], [0, 1]]
    assert ids[0][0].group(1) == ids[0][1].group(1) != ids[1][0].group(1)  # one request id per prompt
    used = tiny_backend.sequences.use([s.sequence_id for s in outs[1].sequences])
    assert [r.prompt.tolist() for r in used.values()] == [[8, 9], [8, 9]]
