"""Typed objects, their Tinker JSON shape, and the batch validation messages.

Where the official ``tinker`` client is installed, its own objects (and the JSON its
pydantic models produce) are fed in, so "Tinker-compatible" is checked against the real
thing rather than against our reading of it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from skyrl_sdk import builtin_plugins as plugins
from skyrl_sdk import types
from skyrl_sdk.errors import AdamParamsError, DatumError, InputError
from skyrl_sdk.inputs import coerce
from skyrl_sdk.inputs import tinker_json as serde
from skyrl_sdk.inputs.coerce import data_from_any
from skyrl_sdk.losses.validation import validate_data


def _tinker():
    return pytest.importorskip("tinker", reason="the official tinker client (skyrl-sdk[server])")


def _datum(n=4, **inputs):
    tokens = list(range(1, n + 1))
    inputs.setdefault("target_tokens", [t + 1 for t in tokens])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


# ---- TensorData ----------------------------------------------------------------------------


def test_tensor_data_from_numpy_keeps_kind_and_narrows_width():
    ints = types.TensorData.from_numpy(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert (ints.dtype, ints.shape, ints.to_numpy().dtype) == ("int64", (2, 2), np.int64)
    floats = types.TensorData.from_numpy(np.array([0.5, 1.5], dtype=np.float64))
    assert (floats.dtype, floats.to_numpy().dtype) == ("float32", np.float32)
    forced = types.TensorData.from_numpy(np.array([1, 2]), dtype="float32")
    assert forced.dtype == "float32" and forced.tolist() == [1.0, 2.0]


def test_tensor_data_from_torch_and_back():
    t = types.TensorData.from_torch(torch.tensor([1.25, -2.0], dtype=torch.float64))
    assert t.dtype == "float32"
    back = t.to_torch()
    assert back.dtype == torch.float32 and back.tolist() == [1.25, -2.0]
    bf16 = types.TensorData.from_torch(torch.tensor([0.5, 2.0], dtype=torch.bfloat16))
    assert bf16.dtype == "float32" and bf16.tolist() == [0.5, 2.0]
    ids = types.TensorData.from_torch(torch.tensor([3, 4], dtype=torch.int32))
    assert ids.dtype == "int64" and ids.to_torch().dtype == torch.int64
    grad = torch.tensor([1.0, 2.0], requires_grad=True) * 2
    assert types.TensorData.from_torch(grad).tolist() == [2.0, 4.0]


def test_tensor_data_from_list_with_shape():
    t = types.TensorData.from_list([1, 2, 3, 4, 5, 6], "int64", shape=[2, 3])
    assert (t.dtype, t.shape, t.tolist()) == ("int64", (2, 3), [[1, 2, 3], [4, 5, 6]])
    assert len(t) == 2
    assert types.TensorData.from_list([1, 2]).dtype == "float32"


@pytest.mark.parametrize("bad", [[[1, 2], [3]], ["a", "b"], [None, 1.0]])
def test_tensor_data_rejects_ragged_or_non_numeric(bad):
    with pytest.raises(InputError, match="TensorData"):
        types.TensorData.from_list(bad)


@pytest.mark.parametrize(
    "value",
    [[1, 2, 3], np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), np.array([1.0, 2.0, 3.0]),
     types.TensorData.from_list([1, 2, 3], "float32")],
    ids=["list", "numpy", "torch", "float-array", "tensordata-float"],
)
def test_dtype_coercion_by_key(value):
    targets = types.to_tensor_data(value, "target_tokens")
    assert targets.dtype == "int64" and targets.tolist() == [1, 2, 3]
    weights = types.to_tensor_data(value, "weights")
    assert weights.dtype == "float32" and weights.tolist() == [1.0, 2.0, 3.0]
    assert types.to_tensor_data(value, "my_plugin_key").dtype == "float32"


@pytest.mark.parametrize("bad", [[1.0, 2.5], [1.0, float("nan")], torch.tensor([0.5])])
def test_fractional_or_nonfinite_token_ids_are_rejected(bad):
    with pytest.raises(InputError, match=r"loss_fn_inputs\['target_tokens'\].*integer token ids"):
        types.to_tensor_data(bad, "target_tokens")


def test_tensor_data_from_official_tinker_dense():
    tk = _tinker()
    td = tk.TensorData.from_numpy(np.array([[1.5, 2.0], [0.0, -1.0]], dtype=np.float32))
    ours = types.to_tensor_data(td, "weights")
    assert ours.shape == (2, 2) and ours.tolist() == [[1.5, 2.0], [0.0, -1.0]]


# ---- sparse CSR ----------------------------------------------------------------------------


def _sparse_dense() -> torch.Tensor:
    dense = torch.zeros(4, 8, dtype=torch.long)
    dense[0, 1], dense[2, 3], dense[2, 7], dense[3, 0] = 5, 7, 9, 11
    return dense


def test_sparse_csr_from_official_tinker_client_is_densified():
    tk = _tinker()
    dense = _sparse_dense()
    td = tk.TensorData.from_torch_sparse(dense)
    assert td.sparse_crow_indices is not None, "tinker chose dense; make the example sparser"
    ours = types.to_tensor_data(td, "target_tokens")
    assert ours.dtype == "int64" and ours.tolist() == dense.tolist()
    weights = types.to_tensor_data(tk.TensorData.from_torch_sparse(dense.float() / 2), "weights")
    assert weights.dtype == "float32" and weights.tolist() == (dense.float() / 2).tolist()


def test_sparse_csr_json_dict_is_densified():
    obj = {"data": [5, 7, 9], "dtype": "int64", "shape": [3, 4],
           "sparse_crow_indices": [0, 1, 1, 3], "sparse_col_indices": [2, 0, 3]}
    t = serde.tensor_from_json(obj)
    assert t.dtype == "int64" and t.tolist() == [[0, 0, 5, 0], [0, 0, 0, 0], [7, 0, 0, 9]]
    datum = serde.datum_from_json({"model_input": {"chunks": [{"tokens": [1, 2, 3]}]},
                                   "loss_fn_inputs": {"target_tokens": obj}})
    assert datum.loss_fn_inputs["target_tokens"].shape == (3, 4)


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"sparse_crow_indices": [0, 2, 1, 3]}, "non-decreasing"),
        ({"sparse_crow_indices": [0, 1, 1, 2]}, "3 values"),
        ({"sparse_col_indices": [2, 0, 4]}, "out of range"),
        ({"shape": [3]}, "2-D"),
        ({"shape": None}, "needs 'shape'"),
    ],
)
def test_malformed_sparse_csr_is_an_input_error(patch, match):
    obj = {"data": [5, 7, 9], "dtype": "int64", "shape": [3, 4],
           "sparse_crow_indices": [0, 1, 1, 3], "sparse_col_indices": [2, 0, 3], **patch}
    with pytest.raises(InputError, match=match):
        serde.tensor_from_json(obj)


# ---- ModelInput ----------------------------------------------------------------------------


def test_model_input_concatenates_chunks():
    mi = types.ModelInput([types.EncodedTextChunk([1, 2]), types.EncodedTextChunk(np.array([3])),
                           types.EncodedTextChunk(torch.tensor([4, 5]))])
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5
    assert mi.to_numpy().dtype == np.int64
    assert mi.append_int(6).to_ints() == [1, 2, 3, 4, 5, 6]
    assert types.ModelInput.empty().to_ints() == [] and types.ModelInput.empty().length == 0


def test_model_input_from_official_tinker_and_json_chunks():
    tk = _tinker()
    theirs = tk.types.ModelInput(chunks=[tk.types.EncodedTextChunk(tokens=[7, 8]),
                                         tk.types.EncodedTextChunk(tokens=[9])])
    datum = types.Datum(model_input=theirs, loss_fn_inputs={"target_tokens": [8, 9, 10]})
    assert datum.model_input.to_ints() == [7, 8, 9]
    from_json = serde.model_input_from_json(theirs.model_dump(mode="json"))
    assert from_json.to_ints() == [7, 8, 9] and len(from_json.chunks) == 2


def test_image_chunks_round_trip_json_and_other_chunks_are_rejected():
    tk = _tinker()
    theirs = tk.types.ModelInput(chunks=[tk.types.EncodedTextChunk(tokens=[1]),
                                         tk.types.ImageChunk(data=b"\x89PNG bytes", format="png", expected_tokens=4)])
    ours = serde.model_input_from_json(theirs.model_dump(mode="json"))  # the data as base64 text
    assert ours.length == 5 and ours.chunks[1].data == b"\x89PNG bytes"
    assert serde.unstructure(types.Datum(model_input=ours))["model_input"] == theirs.model_dump(mode="json")
    with pytest.raises(InputError, match=r"chunks\[1\] \(image\): missing \['format'\]"):
        serde.model_input_from_json({"chunks": [{"tokens": [1]}, {"type": "image", "data": "AAAA"}]})
    with pytest.raises(InputError, match=r"chunks\[1\].*'video'"):
        serde.model_input_from_json({"chunks": [{"tokens": [1]}, {"type": "video", "data": "..."}]})

    class ImageChunk:
        pass

    class Holder:
        chunks = [ImageChunk()]

    with pytest.raises(InputError, match="ImageChunk"):
        types.Datum(model_input=Holder())


# ---- Datum coercion ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [list, np.array, torch.tensor, lambda v: types.TensorData.from_list(v, "float32")],
    ids=["list", "numpy", "torch", "tensordata"],
)
def test_datum_coerces_every_input_form(make):
    d = types.Datum(model_input=make([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": make([2, 3, 4]), "weights": make([1, 0, 1])})
    assert d.model_input.to_ints() == [1, 2, 3]
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert d.loss_fn_inputs["weights"].dtype == "float32"
    assert d.loss_fn_inputs["weights"].tolist() == [1.0, 0.0, 1.0]


def test_datum_from_official_tinker_datum():
    tk = _tinker()
    dense = _sparse_dense()
    theirs = tk.types.Datum(
        model_input=tk.types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": dense, "weights": torch.ones(4, 8), "advantages": [0.5, 1, 2, 3]},
    )
    for ours in (coerce.datum_from_any(theirs), data_from_any([theirs])[0]):
        assert ours.model_input.to_ints() == [1, 2, 3, 4]
        assert ours.loss_fn_inputs["target_tokens"].tolist() == dense.tolist()
        assert ours.loss_fn_inputs["weights"].shape == (4, 8)
        assert ours.loss_fn_inputs["advantages"].dtype == "float32"


# ---- serde ---------------------------------------------------------------------------------


def test_datum_round_trips_through_tinker_json():
    d = _datum(4, weights=[1.0, 0.0, 0.5, 1.0], advantages=np.array([0.25, -1.0, 2.0, 0.0]))
    doc = json.loads(json.dumps(serde.unstructure(d)))
    assert doc["model_input"] == {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]}
    assert doc["loss_fn_inputs"]["target_tokens"] == {"data": [2, 3, 4, 5], "dtype": "int64", "shape": [4]}
    back = serde.structure(doc, types.Datum)
    for key, value in d.loss_fn_inputs.items():
        assert back.loss_fn_inputs[key].dtype == value.dtype
        np.testing.assert_array_equal(back.loss_fn_inputs[key].to_numpy(), value.to_numpy())
    assert back.model_input.to_ints() == d.model_input.to_ints()


def test_two_dimensional_tensors_keep_their_shape_in_json():
    d = types.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [[1, 2, 3], [4, 5, 6]],
                                                       "weights": [[1, 0, 0], [0.5, 0.5, 0]]})
    doc = json.loads(json.dumps(serde.unstructure(d)))
    assert doc["loss_fn_inputs"]["target_tokens"]["shape"] == [2, 3]
    back = serde.structure(doc, types.Datum)
    assert back.loss_fn_inputs["weights"].tolist() == [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]


def test_parse_json_made_by_official_tinker_models():
    tk = _tinker()
    pyd = pytest.importorskip("tinker.types._pydantic_types.datum")
    dense = _sparse_dense()
    theirs = pyd.Datum(
        model_input=tk.types.ModelInput(chunks=[tk.types.EncodedTextChunk(tokens=[1, 2]),
                                                tk.types.EncodedTextChunk(tokens=[3, 4])]),
        loss_fn_inputs={"target_tokens": dense, "weights": torch.ones(4, 8),
                        "advantages": np.array([0.5, 1.0, -2.0, 0.0], dtype=np.float32)},
    )
    doc = json.loads(json.dumps(theirs.model_dump(mode="json")))
    assert doc["loss_fn_inputs"]["target_tokens"].get("sparse_crow_indices") is not None
    ours = serde.structure(doc, types.Datum)
    assert ours.model_input.to_ints() == [1, 2, 3, 4]
    assert ours.loss_fn_inputs["target_tokens"].tolist() == dense.tolist()
    assert ours.loss_fn_inputs["advantages"].tolist() == [0.5, 1.0, -2.0, 0.0]
    # ...and what we write, their model reads back.
    again = pyd.Datum.model_validate(serde.unstructure(ours))
    assert again.loss_fn_inputs["target_tokens"].to_numpy().tolist() == dense.tolist()


def test_bare_lists_in_json_take_the_key_dtype():
    d = serde.datum_from_json({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3],
                                                                        "weights": [1, 1]}})
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].dtype == "float32"


@pytest.mark.parametrize(
    "obj, match",
    [
        ({"dtype": "int64"}, "'data' field"),
        ({"data": [1], "dtype": "bfloat16"}, "dtype must be"),
        ({"data": [1, 2, 3], "dtype": "float32", "shape": [2]}, "does not match"),
    ],
)
def test_bad_tensor_json_is_an_input_error(obj, match):
    with pytest.raises(InputError, match=match):
        serde.tensor_from_json(obj)


def test_forward_backward_output_round_trips():
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="scalar",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_list([-0.5, -1.25])}],
        metrics={"loss:sum": 1.75, "num_loss_tokens:sum": 2.0},
    )
    doc = json.loads(json.dumps(serde.unstructure(out)))
    back = serde.structure(doc, types.ForwardBackwardOutput)
    assert back.metrics == out.metrics and back.loss_fn_output_type == "scalar"
    assert back.loss_fn_outputs[0]["logprobs"].tolist() == [-0.5, -1.25]


def test_adam_params_and_lora_from_dicts_and_official_objects():
    assert coerce.adam_params_from_any({"learning_rate": 3e-4, "beta2": 0.99}) == types.AdamParams(3e-4, beta2=0.99)
    assert serde.structure(serde.unstructure(types.AdamParams(eps=1e-8)), types.AdamParams).eps == 1e-8
    assert coerce.lora_config_from_any({"rank": 4}).rank == 4
    assert coerce.lora_config_from_any(None) is None
    tk = _tinker()
    assert coerce.adam_params_from_any(tk.AdamParams(learning_rate=2e-5, grad_clip_norm=1.0)) == types.AdamParams(
        learning_rate=2e-5, grad_clip_norm=1.0
    )
    lora = coerce.lora_config_from_any(tk.types.LoraConfig(rank=16, train_unembed=False))
    assert (lora.rank, lora.train_unembed, lora.alpha) == (16, False, 32.0)


# ---- AdamParams / LoraConfig validation ----------------------------------------------------


def test_adam_params_defaults_are_tinkers():
    p = types.AdamParams()
    assert (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm) == (
        1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0
    )


@pytest.mark.parametrize(
    "field, bad",
    [
        ("learning_rate", -1e-4), ("learning_rate", math.nan), ("learning_rate", math.inf), ("learning_rate", "1e-4"),
        ("learning_rate", True), ("learning_rate", None),
        ("beta1", -0.1), ("beta1", 1.0), ("beta2", 1.0), ("beta2", -0.5),
        ("eps", 0.0), ("eps", -1e-8), ("weight_decay", -0.01), ("grad_clip_norm", -1.0),
    ],
)
def test_each_bad_adam_field_names_itself(field, bad):
    with pytest.raises(AdamParamsError, match=rf"AdamParams\.{field}: expected .*got {bad!r}"):
        types.AdamParams(**{field: bad})


def test_adam_params_error_is_a_value_error_and_edges_are_allowed():
    assert issubclass(AdamParamsError, ValueError)
    types.AdamParams(learning_rate=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0, grad_clip_norm=0.0)
    p = types.AdamParams(learning_rate=np.float32(1e-3), beta1=np.float64(0.8), eps=1)
    assert type(p.learning_rate) is float and type(p.beta1) is float and type(p.eps) is float


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0}, "LoraConfig.rank"), ({"rank": -4}, "LoraConfig.rank"), ({"rank": 2.5}, "LoraConfig.rank"),
        ({"rank": True}, "LoraConfig.rank"),
        ({"alpha": 0}, "LoraConfig.alpha"), ({"alpha": math.nan}, "LoraConfig.alpha"),
        ({"train_mlp": False, "train_attn": False, "train_unembed": False}, "at least one of"),
    ],
)
def test_lora_config_validation(kwargs, match):
    with pytest.raises(InputError, match=match):
        types.LoraConfig(**kwargs)


def test_lora_config_defaults():
    c = types.LoraConfig()
    assert (c.rank, c.alpha, c.train_mlp, c.train_attn, c.train_unembed) == (8, 32.0, True, True, True)
    assert types.LoraConfig(rank=4, alpha=16, train_unembed=False).alpha == 16


@pytest.mark.parametrize("raw, match", [
    ({"rank": 0}, "LoraConfig.rank"),
    ({"rank": 4, "dropout": 0.1}, "unknown keys \\['dropout'\\]"),
])
def test_lora_config_from_dict_errors_name_the_field(raw, match):
    from skyrl_sdk.inputs.coerce import lora_config_from_any

    with pytest.raises(InputError, match=match):
        lora_config_from_any(raw)
    assert lora_config_from_any({"rank": 4, "seed": None}).rank == 4


@pytest.mark.parametrize("raw, match", [
    ({"learning_rate": -1.0}, "AdamParams.learning_rate"),
    ({"lr": 1e-3}, "unknown keys \\['lr'\\]"),
    ({"beta1": "0.5"}, "AdamParams.beta1"),
])
def test_adam_params_from_dict_errors_name_the_field(raw, match):
    from skyrl_sdk.errors import AdamParamsError
    from skyrl_sdk.inputs.coerce import adam_params_from_any

    with pytest.raises(AdamParamsError, match=match):
        adam_params_from_any(raw)


def test_tinker_json_tensor_with_fractional_token_ids_is_rejected():
    from skyrl_sdk.inputs.tinker_json import datum_from_json

    raw = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
           "loss_fn_inputs": {"target_tokens": {"data": [2.7, 3.2], "dtype": "int64", "shape": [2]}}}
    with pytest.raises(InputError, match="fractional"):
        datum_from_json(raw)


# ---- validate_data -------------------------------------------------------------------------


@pytest.fixture
def ce_spec():
    return plugins.get_registry().losses["cross_entropy"]


def test_valid_batch_passes(ce_spec):
    validate_data([_datum(3), _datum(5, weights=[1, 1, 0, 0, 1])], ce_spec, vocab_size=100)


def test_missing_required_input_names_datum_and_key(ce_spec):
    bad = types.Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": [1, 1, 1]})
    with pytest.raises(DatumError, match=r"^datum 1: loss 'cross_entropy' requires input 'target_tokens'") as e:
        validate_data([_datum(3), bad], ce_spec, vocab_size=100)
    assert e.value.index == 1 and "got keys ['weights']" in str(e.value)


def test_unknown_input_lists_accepted_ones(ce_spec):
    with pytest.raises(DatumError, match=r"datum 0, loss_fn_inputs\['advantages'\]: .*does not take this input; "
                                          r"accepted inputs: \['target_tokens', 'weights'\]"):
        validate_data([_datum(3, advantages=[1, 1, 1])], ce_spec, vocab_size=None)


def test_length_mismatch_says_expected_and_got(ce_spec):
    with pytest.raises(DatumError, match=r"datum 2, loss_fn_inputs\['weights'\]: expected first dimension 4 "
                                          r"\(the model_input length\), got shape \[3\]") as e:
        validate_data([_datum(4), _datum(4), _datum(4, weights=[1, 1, 1])], ce_spec, vocab_size=None)
    assert (e.value.index, e.value.key) == (2, "weights")


def test_token_out_of_vocab_names_position(ce_spec):
    with pytest.raises(DatumError, match=r"datum 0, loss_fn_inputs\['target_tokens'\]: token ids must be in "
                                          r"\[0, 5\) .*got 5 at flat position 3"):
        validate_data([_datum(4)], ce_spec, vocab_size=5)
    with pytest.raises(DatumError, match=r"datum 0, model_input: token ids must be in \[0, 3\)"):
        validate_data([_datum(4)], ce_spec, vocab_size=3)


def test_non_finite_weights_and_empty_input(ce_spec):
    with pytest.raises(DatumError, match=r"datum 0, loss_fn_inputs\['weights'\]: expected finite values, got nan"):
        validate_data([_datum(3, weights=[1, math.nan, 1])], ce_spec, vocab_size=None)
    empty = types.Datum(model_input=types.ModelInput.empty(), loss_fn_inputs={"target_tokens": []})
    with pytest.raises(DatumError, match=r"datum 0, model_input: model_input is empty"):
        validate_data([empty], ce_spec, vocab_size=None)


def test_topk_shapes(ce_spec):
    topk = types.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [[1, 2], [3, 4]],
                                                          "weights": [[0.5, 0.5], [1, 0]]})
    validate_data([topk], ce_spec, vocab_size=10)
    mismatch = types.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [[1, 2], [3, 4]],
                                                              "weights": [[0.5, 0.5, 0], [1, 0, 0]]})
    with pytest.raises(DatumError, match=r"weights shape \[2, 3\] must equal target_tokens shape \[2, 2\]"):
        validate_data([mismatch], ce_spec, vocab_size=10)
    three_d = types.Datum(model_input=[1], loss_fn_inputs={"target_tokens": [[[1]]]})
    with pytest.raises(DatumError, match=r"expected shape \(N,\) or \(N, K\) with N=1, got \[1, 1, 1\]"):
        validate_data([three_d], ce_spec, vocab_size=10)


@pytest.mark.parametrize(
    "data, match",
    [
        ([], "data is empty"),
        (_datum(2), "must be a list of Datum, got Datum"),
        ({"model_input": [1]}, "must be a list of Datum, got dict"),
        ("abc", "must be a list of Datum, got str"),
        ([_datum(2), 42], r"datum 1: not a valid Datum"),
        ([{"loss_fn_inputs": {}}], r"datum 0: not a valid Datum: datum: expected a 'model_input' field"),
    ],
)
def test_coerce_data_errors(data, match):
    with pytest.raises(InputError, match=match):
        data_from_any(data)


def test_coerce_data_accepts_mixed_forms():
    out = data_from_any([_datum(2), serde.unstructure(_datum(3)), (_datum(1))])
    assert [d.model_input.length for d in out] == [2, 3, 1]
