"""Tinker's wire formats <-> skyrl-sdk types.

The protobuf schema is the one shipped inside the ``tinker`` package
(``tinker.proto.tinker_public_pb2``); nothing here re-types it. JSON bodies are read as
plain dicts with clear errors for missing or malformed fields.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from ..errors import DatumError, InputError
from ..serde import model_input_from_json
from ..types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, SampleOutput, SamplingParams, densify_csr

_PROTO_TO_NUMPY = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}
_NUMPY_TO_PROTO = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}


# ---- forward_backward request ---------------------------------------------------------------
@attrs.frozen(eq=False)
class FwdBwdRequest:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    forward_only: bool
    data: list[Datum] | None  # None when the data failed to decode (see ``error``)
    error: str | None = None


def parse_forward_backward(body: bytes) -> FwdBwdRequest:
    """Decode a protobuf ``ForwardBackwardRequest``.

    Raises InputError only when even the model id cannot be read; a bad datum is reported
    through ``error`` so the request still gets a future (and a clear failed result).
    """
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise InputError(f"forward_backward: body is not a valid ForwardBackwardRequest protobuf ({exc})") from None
    config: dict[str, Any] = {}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    for key, value in msg.loss_fn_config.items():
        config.setdefault(key, value)
    data, error = None, None
    try:
        data = [_datum_from_proto(d, i) for i, d in enumerate(msg.data)]
        if not data:
            raise InputError("forward_backward: no data (send at least one datum)")
    except InputError as exc:
        error = str(exc)
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id if msg.seq_id > 0 else None,
        loss_fn=msg.loss_fn or "cross_entropy",
        loss_fn_config=config or None,
        forward_only=bool(msg.forward_only),
        data=data,
        error=error,
    )


def _datum_from_proto(msg: Any, index: int) -> Datum:
    chunks = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise DatumError(f"model_input chunk {j} is a {kind!r} chunk; only encoded_text is supported",
                             index=index)
        tokens = chunk.encoded_text.tokens
        if len(tokens) % 4:
            raise DatumError(f"model_input chunk {j}: token bytes are not a whole number of int32", index=index)
        chunks.append(EncodedTextChunk(np.frombuffer(tokens, dtype=np.int32).astype(np.int64)))
    inputs = {}
    for key, tensor in msg.loss_fn_inputs.items():
        try:
            inputs[key] = tensor_from_proto(tensor)
        except InputError as exc:
            raise DatumError(str(exc), index=index, key=key) from None
    try:
        return Datum(model_input=ModelInput(chunks), loss_fn_inputs=inputs)
    except DatumError:
        raise
    except InputError as exc:
        raise DatumError(str(exc), index=index) from None


def tensor_from_proto(msg: Any) -> np.ndarray:
    """A proto ``Tensor`` (dense or sparse CSR) as a dense numpy array."""
    np_dtype = _PROTO_TO_NUMPY.get(msg.dtype)
    if np_dtype is None:
        raise InputError(f"unsupported tensor dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise InputError(f"negative tensor shape {shape}")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, np_dtype, "sparse values")
        crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), "sparse crow_indices")
        cols = _frombuffer(csr.col_indices, np.dtype(np.int64), "sparse col_indices")
        dtype = "int64" if np_dtype.kind in "iu" else "float32"
        return densify_csr(values, crow, cols, shape, dtype)
    array = _frombuffer(msg.dense if encoding == "dense" else b"", np_dtype, "tensor data")
    if shape:
        if int(np.prod(shape)) != array.size:
            raise InputError(f"tensor shape {shape} does not match its {array.size} values")
        array = array.reshape(shape)
    return array


def _frombuffer(data: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise InputError(f"{what}: {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype).copy()


# ---- forward_backward output ----------------------------------------------------------------
def forward_backward_output_to_proto(out: ForwardBackwardOutput) -> bytes:
    """Our output as a protobuf ``ForwardBackwardOutput`` (one ArrayRecord per run of
    consecutive datums whose fields share dtype and trailing shape)."""
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = out.loss_fn_output_type or "ArrayRecord"
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    arrays = [{k: np.ascontiguousarray(v.to_numpy() if hasattr(v, "to_numpy") else v) for k, v in o.items()}
              for o in out.loss_fn_outputs]
    for arrays_group in _group_by_layout(arrays):
        record = msg.loss_fn_outputs.add()
        record.type_tag = "ArrayRecord"
        record.num_datums = len(arrays_group)
        for name in arrays_group[0]:
            first = _wire_array(arrays_group[0][name])
            batched = record.fields[name]
            batched.dtype = _NUMPY_TO_PROTO[first.dtype]
            batched.trailing_shape.extend(first.shape[1:])
            parts = [_wire_array(d[name]) for d in arrays_group]
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([p.nbytes for p in parts])
            batched.data = b"".join(p.tobytes() for p in parts)
            batched.offsets = offsets.tobytes()
    return msg.SerializeToString()


def _wire_array(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iub":
        return a.astype(np.int64, copy=False)
    return a.astype(np.float32, copy=False)


def _layout(d: Mapping[str, np.ndarray]) -> tuple:
    return tuple((k, _wire_array(v).dtype.str, tuple(v.shape[1:])) for k, v in d.items())


def _group_by_layout(arrays: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    groups: list[list[dict[str, np.ndarray]]] = []
    last = None
    for d in arrays:
        lay = _layout(d)
        if groups and lay == last:
            groups[-1].append(d)
        else:
            groups.append([d])
            last = lay
    return groups


# ---- sampling ---------------------------------------------------------------------------------
UNSUPPORTED_SAMPLE_FIELDS = {
    "topk_prompt_logprobs": "top-k prompt logprobs",
    "topk_sample_logprobs": "top-k sample logprobs",
    "prompt_alt_tokens_k": "prompt_alt_tokens_k",
}


@attrs.frozen(eq=False)
class SampleSpec:
    prompt: np.ndarray
    params: SamplingParams
    num_samples: int
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None


def parse_sample_request(body: Mapping[str, Any]) -> SampleSpec:
    """Validate a JSON ``SampleRequest`` (everything except where to sample from)."""
    for field, what in UNSUPPORTED_SAMPLE_FIELDS.items():
        if body.get(field):
            raise InputError(f"{what} ({field}) is not supported by skyrl-sdk serve")
    if body.get("target_prompt_logprobs") is not None:
        raise InputError("target_prompt_logprobs is not supported by skyrl-sdk serve")
    if "prompt" not in body:
        raise InputError("sample: missing 'prompt'")
    prompt = model_input_from_json(body["prompt"]).to_numpy()
    if prompt.size == 0:
        raise InputError("sample: the prompt is empty")
    num_samples = body.get("num_samples", 1)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise InputError(f"num_samples: expected an integer >= 1, got {num_samples!r}")
    params = sampling_params_from_json(body.get("sampling_params") or {})
    plp = bool(body.get("prompt_logprobs") or False)
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not plp:
            raise InputError("prompt_logprobs_last_n needs prompt_logprobs")
        if not isinstance(last_n, int) or not 1 <= last_n <= prompt.size - 1:
            raise InputError(f"prompt_logprobs_last_n: expected 1..{prompt.size - 1}, got {last_n!r}")
    return SampleSpec(prompt=prompt, params=params, num_samples=num_samples, prompt_logprobs=plp,
                      prompt_logprobs_last_n=last_n)


def sampling_params_from_json(obj: Mapping[str, Any]) -> SamplingParams:
    if not isinstance(obj, Mapping):
        raise InputError(f"sampling_params: expected an object, got {type(obj).__name__}")
    kwargs: dict[str, Any] = {}
    for key in ("max_tokens", "temperature", "top_k", "top_p", "seed"):
        if obj.get(key) is not None:
            kwargs[key] = obj[key]
    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, Sequence) or not all(
            isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool)) for s in stop
        ):
            raise InputError(f"sampling_params.stop: expected strings or token ids, got {stop!r}")
        kwargs["stop"] = tuple(stop)
    if "temperature" in kwargs:
        kwargs["temperature"] = float(kwargs["temperature"])
    if "top_p" in kwargs:
        kwargs["top_p"] = float(kwargs["top_p"])
    try:
        return SamplingParams(**kwargs)
    except TypeError as exc:
        raise InputError(f"sampling_params: {exc}") from None


def sample_output_to_proto(out: SampleOutput, last_n: int | None = None) -> bytes:
    msg = pb.SampleResponse()
    for seq in out.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if out.prompt_logprobs is not None:
        lps = [math.nan if v is None else float(v) for v in out.prompt_logprobs]
        if last_n is not None:
            lps = [math.nan] * (len(lps) - last_n) + lps[len(lps) - last_n:]
        msg.prompt_logprobs = np.asarray(lps, dtype=np.float32).tobytes()
    return msg.SerializeToString()
