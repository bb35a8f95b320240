"""One input path: a value is typed once, through ``skyrl_sdk.inputs``, whether it comes from
Python or from the server's wire (JSON or protobuf), and a key a request object does not have
is refused everywhere, by name, with the nearest known key; in the same words both ways.

(The end-to-end HTTP side: tests/test_server_limits.py::test_unknown_keys_are_refused_over_http.)
"""

from __future__ import annotations

import dataclasses
import json

import attrs
import numpy as np
import pytest

from skyrl_sdk import errors, types
from skyrl_sdk.errors import InputError
from skyrl_sdk.inputs import coerce, sample, tinker_json

tinker = pytest.importorskip("tinker")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from skyrl_sdk.inputs import tinker_proto
from skyrl_sdk.server.wire import envelopes as wire


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(InputError) as caught:
        fn(*args, **kwargs)
    return str(caught.value)


# ---- the same words in process and over the wire ------------------------------------------------------
@pytest.mark.parametrize("params, key, hint", [
    ({"temprature": 0.5}, "temprature", "temperature"),
    ({"max_token": 4}, "max_token", "max_tokens"),
    ({"top_p": 0.9, "seeed": 3}, "seeed", "seed"),
])
def test_an_unknown_sampling_key_is_refused_alike_in_process_and_over_the_wire(params, key, hint):
    in_process = _message(sample.sample_request_from_any, [[1, 2, 3]], params)
    over_http = _message(wire.parse_sample_request, {"prompt": {"chunks": [{"type": "encoded_text",
                                                                            "tokens": [1, 2, 3]}]},
                                                     "sampling_params": params}, 8)
    assert over_http == in_process
    assert f"SamplingParams: unknown keys ['{key}']" in in_process and f"did you mean '{hint}'?" in in_process


def test_backend_sample_refuses_an_unknown_sampling_key_before_any_compute(tiny_backend):
    message = _message(tiny_backend.sample, [[1, 2, 3]], {"temprature": 0.5})
    assert message == _message(sample.sample_request_from_any, [[1, 2, 3]], {"temprature": 0.5})


def test_sample_counts_and_lengths_read_alike():
    body = {"prompt": [1, 2, 3], "num_samples": 0}
    assert _message(wire.parse_sample_request, body, 8) == _message(sample.sample_request_from_any, [[1, 2, 3]], None,
                                                                    num_samples=0, max_num_samples=8)
    assert "num_samples: expected an integer in 1..8, got 9" in _message(
        wire.parse_sample_request, {**body, "num_samples": 9}, 8)
    spec = wire.parse_sample_request({"prompt": [1, 2, 3], "sampling_params": {"max_tokens": 8}}, 8)
    server = _message(spec.check_length, 10)
    from skyrl_sdk.losses.validation import check_prompts
    local = _message(check_prompts, [np.arange(3)], 320, 10, 8)
    assert server.split(" (")[0:2] == local.split(" (")[0:2]  # the same words; only the limit's source differs
    assert "the prompt (3 tokens) plus max_tokens (8) has 11 tokens; this model accepts at most 10" in server


def test_adam_params_and_lora_config_read_alike():
    from skyrl_sdk.server.compute.runtime import lora_config_from_any as server_lora  # what create_model uses

    assert server_lora is coerce.lora_config_from_any
    assert _message(wire.parse_adam_params, {"adam_params": {"lr": 1e-3}}) == _message(
        coerce.adam_params_from_any, {"lr": 1e-3})
    assert wire.parse_adam_params({"adam_params": {"learning_rate": 2e-5, "beta2": 0.99}}) == types.AdamParams(
        learning_rate=2e-5, beta2=0.99)


# ---- one policy for unknown keys: every request object ------------------------------------------------
DATUM = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}}}


@pytest.mark.parametrize("build, key, hint", [
    (lambda: coerce.sampling_params_from_any({"temprature": 1.0}), "temprature", "temperature"),
    (lambda: coerce.sampling_params_from_any({"stpo": ["x"]}), "stpo", "stop"),
    (lambda: coerce.adam_params_from_any({"weight_decy": 0.1}), "weight_decy", "weight_decay"),
    (lambda: coerce.lora_config_from_any({"rnak": 4}), "rnak", "rank"),
    (lambda: tinker_json.datum_from_json({**DATUM, "loss_fn_input": {}}), "loss_fn_input", "loss_fn_inputs"),
    (lambda: tinker_json.model_input_from_json({"chunk": []}), "chunk", "chunks"),
    (lambda: tinker_json.model_input_from_json({"chunks": [{"type": "encoded_text", "tokns": [1]}]}),
     "tokns", "tokens"),
    (lambda: tinker_json.tensor_from_json({"data": [1.0], "dtype": "float32", "shpe": [1]}), "shpe", "shape"),
    (lambda: coerce.data_from_any([DATUM, {**DATUM, "model_inputs": {}}]), "model_inputs", "model_input"),
    (lambda: wire.json_request(b'{"session_id": "s", "sampling_sesion_seq_id": 0}', "create_sampling_session"),
     "sampling_sesion_seq_id", "sampling_session_seq_id"),
    (lambda: wire.json_request(b'{"model_id": "m", "seqid": 1}', "optim_step"), "seqid", "seq_id"),
    (lambda: wire.json_request(b'{"prompt": [1], "num_sample": 2}', "asample"), "num_sample", "num_samples"),
    (lambda: wire.json_request(b'{"request_id": "r", "allow_metadata": true}', "retrieve_future"),
     "allow_metadata", "allow_metadata_only"),
    (lambda: wire.parse_new_model({"session_id": "s", "model_seq_id": 0,
                                   "optimizer_config": {"type": "adamw", "lr": 1}}), "lr", None),
])
def test_every_request_object_refuses_an_unknown_key_by_name(build, key, hint):
    message = _message(build)
    assert f"unknown keys ['{key}']" in message and "accepted keys: [" in message
    if hint is not None:
        assert f"did you mean '{hint}'?" in message


def test_a_datums_unknown_key_names_the_datum():
    message = _message(coerce.data_from_any, [DATUM, {**DATUM, "model_inputs": {}}])
    assert message.startswith("datum 1: ")


def test_official_tinker_objects_read_without_loss_and_extra_fields_are_refused():
    theirs = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(np.array([2, 3, 4]))})
    ours = coerce.datum_from_any(theirs)
    assert ours.model_input.to_ints() == [1, 2, 3] and ours.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]

    @dataclasses.dataclass
    class NewerDatum:  # a client's Datum with a field skyrl-sdk does not take: refused, not dropped
        model_input: object
        loss_fn_inputs: dict
        model_input_weights: object = None

    assert coerce.datum_from_any(NewerDatum(theirs.model_input, theirs.loss_fn_inputs)).model_input.length == 3
    message = _message(coerce.data_from_any, [NewerDatum(theirs.model_input, theirs.loss_fn_inputs, [1.0])])
    assert message.startswith("datum 0: ") and "unknown keys ['model_input_weights']" in message


def test_chunk_types_come_from_one_table():
    import base64

    from skyrl_sdk.types.model_input import CHUNK_TYPES

    assert set(CHUNK_TYPES) == {"encoded_text", "image"}
    png = b"\x89PNG fake"
    images = [  # JSON (base64), tinker's pydantic chunk (duck-typed), protobuf: the same ImageChunk
        tinker_json.model_input_from_json({"chunks": [{"type": "image", "data": base64.b64encode(png).decode(),
                                                       "format": "png", "expected_tokens": 4}]}).chunks[0],
        types.ModelInput(tt.ModelInput(chunks=[tt.ImageChunk(data=png, format="png", expected_tokens=4)]).chunks
                         ).chunks[0],
        _proto_datum(image=True).model_input.chunks[1],
    ]
    for image in images:
        assert isinstance(image, types.ImageChunk)
        assert (image.data, image.format, image.expected_tokens) == (png, "png", 4)
    for read in (lambda: tinker_json.model_input_from_json({"chunks": [{"type": "dmel", "dmel": "x"}]}),
                 lambda: types.ModelInput([tt.DmelChunk(dmel=b"x")])):
        assert "chunks of type 'dmel' are not supported; supported types: ['encoded_text', 'image']" in _message(read)
    for read in (lambda: tinker_json.model_input_from_json({"chunks": [{"type": "image_asset_pointer",
                                                                         "format": "png", "location": "/etc/x"}]}),
                 lambda: types.ModelInput(tt.ModelInput(chunks=[tt.ImageAssetPointerChunk(
                     format="png", location="/etc/x")]).chunks)):
        assert "'image_asset_pointer' chunks are not served" in _message(read)
    assert "model_input.chunks[0]: image chunk data: not valid base64" in _message(
        tinker_json.model_input_from_json, {"chunks": [{"type": "image", "data": "**", "format": "png"}]})


# ---- every field the real client sends is accepted ----------------------------------------------------
ROUTE_TYPES = {
    "create_session": tt.CreateSessionRequest, "session_heartbeat": tt.SessionHeartbeatRequest,
    "create_sampling_session": tt.CreateSamplingSessionRequest, "create_model": tt.CreateModelRequest,
    "get_info": tt.GetInfoRequest, "load_weights": tt.LoadWeightsRequest, "save_weights": tt.SaveWeightsRequest,
    "save_weights_for_sampler": tt.SaveWeightsForSamplerRequest, "optim_step": tt.OptimStepRequest,
    "asample": tt.SampleRequest, "retrieve_future": tt.FutureRetrieveRequest,
    "search_sessions": tt.SessionSearchRequest,
}


@pytest.mark.parametrize("route", sorted(ROUTE_TYPES))
def test_every_field_of_the_tinker_clients_requests_is_a_known_key(route):
    fields = set(ROUTE_TYPES[route].model_fields)
    if route == "optim_step":  # serialized as adam_params (or optimizer_params)
        fields |= {"adam_params", "optimizer_params"}
    assert fields <= set(wire.REQUEST_KEYS[route])


def test_every_field_of_the_tinker_clients_values_is_a_known_key():
    def ours(cls) -> set[str]:
        return {a.name for a in attrs.fields(cls)}

    assert set(tt.SamplingParams.model_fields) == ours(types.SamplingParams)
    assert set(tt.AdamParams.model_fields) == ours(types.AdamParams)
    assert set(tt.LoraConfig.model_fields) <= ours(types.LoraConfig)  # and alpha, ours
    assert set(tt.EncodedTextChunk.model_fields) == ours(types.EncodedTextChunk)
    assert set(tt.ModelInput.model_fields) == ours(types.ModelInput)
    tensor_fields = {f.name for f in dataclasses.fields(tt.TensorData) if not f.name.startswith("_")}
    assert tensor_fields | {"data"} == set(tinker_json.TENSOR_KEYS)  # JSON carries the values as "data"
    assert {f.name for f in dataclasses.fields(tt.Datum)} == ours(types.Datum)
    assert coerce.sampling_params_from_any(tt.SamplingParams(max_tokens=3, stop=[7])) == types.SamplingParams(
        max_tokens=3, stop=(7,))


def test_a_sample_request_as_the_client_serializes_it_is_read():
    request = tt.SampleRequest(num_samples=2, prompt=tt.ModelInput.from_ints([5, 6, 7]), base_model="tiny",
                               sampling_params=tt.SamplingParams(max_tokens=4, seed=1, stop=["\n"], temperature=0.7,
                                                                 top_k=5, top_p=0.9),
                               prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2, seq_id=3)
    body = request.model_dump(exclude_unset=False, exclude_none=True, mode="json")
    spec = wire.parse_sample_request(wire.json_request(json.dumps(body).encode(), "asample"), 8)
    call = spec.request
    assert [p.tolist() for p in call.prompts] == [[5, 6, 7]] and call.num_samples == 2
    assert call.sampling_params == types.SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=1,
                                                        stop=("\n",))
    assert call.prompt_logprobs and call.topk_prompt_logprobs == 2 and spec.prompt_logprobs_last_n == 2


def test_the_sample_requests_other_scores_and_stability_flag_are_read_not_ignored():
    ids = -np.ones((2, 2), dtype=np.int64)
    ids[1, 0] = 4
    request = tt.SampleRequest(prompt=tt.ModelInput.from_ints([1, 2, 3]), sampling_params=tt.SamplingParams(),
                               topk_sample_logprobs=2, prompt_alt_tokens_k=3, record_stability_info=True,
                               target_prompt_logprobs={"data": [4], "dtype": "int64", "shape": [2, 2],  # sparse, pad -1
                                                       "sparse_crow_indices": [0, 0, 1], "sparse_col_indices": [0]})
    body = request.model_dump(exclude_unset=False, exclude_none=True, mode="json")
    call = wire.parse_sample_request(wire.json_request(json.dumps(body).encode(), "asample"), 8).request
    assert (call.topk_sample_logprobs, call.prompt_alt_tokens_k, call.record_stability_info) == (2, 3, True)
    assert call.target_prompt_logprobs[0].tolist() == ids.tolist()
    assert "topk_sample_logprobs: expected an integer in 0..20, got 21" in _message(
        wire.parse_sample_request, {"prompt": [1, 2], "topk_sample_logprobs": 21}, 8)


# ---- protobuf -----------------------------------------------------------------------------------------
def _proto_datum(n: int = 3, image: bool = False) -> types.Datum:
    msg = pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(n, dtype=np.int32).tobytes()
    if image:
        chunk = d.model_input.add().image
        chunk.data, chunk.format, chunk.expected_tokens = b"\x89PNG fake", "png", 4
        n += 4
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.arange(1, n + 1).tobytes(), dtype=pb.DTYPE_INT64,
                                                          shape=[n]))
    req = tinker_proto.forward_backward_from_proto(msg.SerializeToString(), lambda model_id: 8)
    if req.error is not None:
        raise InputError(req.error)
    return req.data[0]


def test_protobuf_datums_are_the_same_typed_values():
    datum = _proto_datum()
    assert isinstance(datum, types.Datum) and datum.model_input.to_ints() == [0, 1, 2]
    assert coerce.data_from_any([datum])[0] is datum  # typed once: the facade takes it as it is
    assert "datum 0: model_input has 9 tokens; this model accepts at most 8" in _message(_proto_datum, 9)


def test_outputs_go_to_the_wire_as_the_engine_made_them():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from skyrl_sdk.server.wire.proto import forward_backward_output_to_proto

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (3, 5, 2)]
    out = types.ForwardBackwardOutput("ArrayRecord", [{"logprobs": types.TensorData(a)} for a in arrays],
                                      {"loss:sum": 1.5})
    theirs = deserialize_forward_backward_output(forward_backward_output_to_proto(out))
    assert theirs.metrics == {"loss:sum": 1.5}
    for got, want in zip(theirs.loss_fn_outputs, arrays, strict=True):
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)


def test_errors_module_policy_is_the_one_used():
    assert "did you mean 'beta1' for 'bta1'" in _message(errors.refuse_unknown_keys, "x", ["bta1", "zzz"],
                                                         ["beta1", "beta2"])


@pytest.mark.parametrize("tokens", [[1, True], [1, 2.0], [1.5], ["7"], [1, None]])
def test_a_token_list_holds_integers_only_from_python_and_from_json(tokens):
    for read in (lambda: types.ModelInput.from_ints(tokens), lambda: tinker_json.model_input_from_json(
            {"chunks": [{"type": "encoded_text", "tokens": tokens}]})):
        assert "expected a flat list of token ids (integers)" in _message(read)


def test_numpy_integers_in_a_token_list_are_integers():
    assert types.ModelInput.from_ints([np.int64(3), 4, np.int32(5)]).to_ints() == [3, 4, 5]


def test_provenance_spans_are_counted_from_the_body_before_one_is_built(monkeypatch):
    """Issue 41, item 5. Before: a datum of 3 tokens with 200,000 empty spans (9 MiB of body)
    was accepted, every span built as a mapping and an object first (12x the body in memory).
    Now a field may have one span per position plus one, counted from the message."""
    built = []
    monkeypatch.setattr(tinker_proto, "_spans_from_proto", lambda spans: built.append(len(spans)) or None)
    msg = pb.ForwardBackwardRequest(model_id="m", loss_fn="stable_reinforce")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(3, dtype=np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.arange(1, 4).tobytes(), dtype=pb.DTYPE_INT64,
                                                          shape=[3]))
    for spans in (d.model_input_spans, d.loss_fn_input_spans):
        spans.add().sampled_tokens.CopyFrom(pb.SampledProvenanceSpan(sequence_id="s", length=3))
    empty = pb.ProvenanceSpan(prompt_tokens=pb.PromptProvenanceSpan(sequence_id="s", length=0))
    d.model_input_spans.extend([empty] * 200_000)  # they tile it: 3 + 0 + 0 + ...
    req = tinker_proto.forward_backward_from_proto(msg.SerializeToString(), lambda model_id: 8)
    assert req.error == ("datum 0: model_input_spans: 200001 provenance spans for 3 positions; a field has at most "
                         "one span per position plus 1 (the runs tile it)")
    assert built == []
    with pytest.raises(InputError, match="loss_fn_input_spans: 5 provenance spans for 3 positions"):
        types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4]},
                    model_input_spans=[types.SampledProvenanceSpan("s", 3)],
                    loss_fn_input_spans=[types.SampledProvenanceSpan("s", 3)] + [types.PromptProvenanceSpan("s", 0)] * 4)
    # the layout of a one-token turn (an empty span) is still one more than its positions
    ok = types.Datum(model_input=[1], loss_fn_inputs={"target_tokens": [2]},
                     model_input_spans=[types.PromptProvenanceSpan("s", 1), types.SampledProvenanceSpan("s", 0)],
                     loss_fn_input_spans=[types.PromptProvenanceSpan("s", 0, 1), types.SampledProvenanceSpan("s", 1)])
    assert len(ok.model_input_spans) == 2
