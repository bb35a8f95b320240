"""A call's data takes one way down: the Backend hands what the caller sent to
``skyrl_sdk.losses.calls`` once (made our types, images read, provenance resolved, checked)
and the result to the engine; nothing of the data climbs back to the facade in between."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.errors import DatumError, InputError
from skyrl_sdk.losses.calls import CallModel, prepare_call, prepare_sample
from skyrl_sdk.losses.stability import SequenceRecords

#: what a call's data goes through before the engine: the facade calls none of it itself
DATA_STEPS = {"data_from_any", "resolve_provenance", "inputs_for_forward", "reading_values", "check_call",
              "check_prompts", "check_target_ids", "read_images", "prepare"}


def test_the_facade_hands_a_calls_data_down_once():
    tree = ast.parse((Path(skyrl_sdk.__file__).parent / "backend.py").read_text())
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert called & DATA_STEPS == set()
    assert {"prepare_call", "prepare_sample"} <= called


def _model(vocab_size: int, images, records: SequenceRecords | None = None) -> CallModel:
    return CallModel(name="m", vocab_size=vocab_size, max_positions=None, images=images,
                     sequences=records or SequenceRecords())


class Reader:
    """An image reader that makes each image 3 positions of placeholder token 9 (what a model's
    image processor decides), recording what it was given."""

    def __init__(self) -> None:
        self.calls = []

    def prepare(self, inputs, error):
        self.calls.append(list(inputs))
        image = types.PreparedImageChunk(np.zeros((12, 4), np.float32), (1, 6, 2), 2, 9, "digest")
        return [types.ModelInput([image if isinstance(c, types.ImageChunk) else c for c in mi.chunks])
                for mi in inputs]


def _image_datum(targets: int) -> types.Datum:
    model_input = types.ModelInput([types.EncodedTextChunk(np.array([1, 2])), types.ImageChunk(b"\x89PNG", "png", 3)])
    return types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": np.arange(targets)})


def test_images_are_read_below_the_facade_before_the_call_is_checked():
    registry = skyrl_sdk.get_registry()
    resolved = registry.resolve("cross_entropy")
    reader = Reader()
    model = _model(32, reader)
    datums, _ = prepare_call([_image_datum(5)], resolved, model, backward=True, losses=registry.losses)
    assert len(reader.calls) == 1 and datums[0].model_input.to_ints() == [1, 2, 9, 9, 9]
    with pytest.raises(DatumError, match=r"reads no images"):  # a text model: refused by name
        prepare_call([_image_datum(5)], resolved, _model(32, None), backward=True,
                     losses=registry.losses)
    prompt = types.SampleRequest(prompts=[_image_datum(5).model_input], sampling_params=types.SamplingParams())
    assert prepare_sample(prompt, model).prompts[0].to_ints() == [1, 2, 9, 9, 9]
    with pytest.raises(InputError, match=r"prompt 0: token ids must be in \[0, 8\)"):  # checked after reading
        prepare_sample(prompt, _model(8, reader))


def test_provenance_is_resolved_below_the_facade():
    registry = skyrl_sdk.get_registry()
    records = SequenceRecords()
    out = types.SampleOutput(sequences=[types.SampledSequence(tokens=[4, 5], logprobs=[-0.5, -0.25],
                                                              stop_reason="length")])
    [recorded] = records.record_outputs([np.array([1, 2, 3])], [out])
    sid = recorded.sequences[0].sequence_id
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                        loss_fn_inputs={"target_tokens": np.array([2, 3, 4, 5]), "advantages": np.array([0, 0, 1, 1.0])}
                        ).with_provenance([types.PromptProvenanceSpan(sid, 3), types.SampledProvenanceSpan(sid, 1)],
                                          [types.PromptProvenanceSpan(sid, 2, offset=1),
                                           types.SampledProvenanceSpan(sid, 2)])
    datums, _ = prepare_call([datum], registry.resolve("stable_reinforce"), _model(32, None, records),
                             backward=True, losses=registry.losses)
    np.testing.assert_array_equal(datums[0].loss_fn_inputs["logprobs"].to_numpy(), [0, 0, -0.5, -0.25])
    np.testing.assert_array_equal(datums[0].loss_fn_inputs["sampled_mask"].to_numpy(), [0, 0, 1, 1])
