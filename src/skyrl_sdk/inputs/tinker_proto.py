"""Tinker's protobuf ``ForwardBackwardRequest`` -> our types (what ``skyrl-sdk serve`` receives
from the official client).

The schema is the one shipped inside the ``tinker`` package
(``tinker.proto.tinker_public_pb2``); nothing here re-types it. Declared sizes are checked
against the server's limits before anything is allocated from them; everything else goes
through the same types and checks as a call in process: chunks through
``types.model_input.CHUNK_TYPES``, datums through ``Datum``, set fields the types do not
have refused by name (:func:`~skyrl_sdk.errors.refuse_unknown_keys`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from ..errors import DatumError, InputError, refuse_unknown_keys
from ..types import Datum, ModelInput, densify_csr
from ..types.arrays import TensorDtype
from ..types.model_input import chunk_from_fields
from ..types.numbers import check_number
from ..types.provenance import span_count_problem
from .limits import sequence_length_problem

_PROTO_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}
#: most values per position a loss input may declare (e.g. top-K targets: K <= this)
MAX_VALUES_PER_POSITION = 1024
#: what the server's sequence limit comes from (in its messages)
SERVER_LIMIT = "this server's limit: --max-seq-len, or the model's max_position_embeddings"
#: the largest ``seq_id`` (protobuf's int64)
MAX_SEQ_ID = 2**63 - 1


def check_seq_id(value: Any) -> int | None:
    """A training request's ``seq_id``, one rule for its JSON and its protobuf form: absent
    (None) or an integer 1..int64 (the tinker client numbers a model's requests from 1); 0 in
    a protobuf request is its field's default, so it reads as absent there. Anything else is
    refused by name, in both forms alike: a request numbered outside the order never runs."""
    if value is None:
        return None
    try:
        return check_number("seq_id", value, low=1, high=MAX_SEQ_ID, integer=True)
    except InputError as exc:
        raise InputError(f"{exc} (a model's requests are numbered from 1 in the order they must run; leave "
                         f"seq_id out for a request that waits for none)") from None


@attrs.frozen(eq=False)
class ForwardBackwardRequest:
    """A decoded ``ForwardBackwardRequest``: where it goes, and the call's typed values."""

    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    forward_only: bool
    data: list[Datum] | None  # None when the data failed to decode (see ``error``)
    error: str | None = None
    #: tokens of all its data (what the executor's turns count)
    tokens: int = 0


def forward_backward_from_proto(body: bytes, max_seq_len: Callable[[str], int | None],
                                max_tokens: int | None = None) -> ForwardBackwardRequest:
    """Decode a protobuf ``ForwardBackwardRequest``; ``max_seq_len(model_id)`` is the longest
    datum the model accepts (None: no limit); ``max_tokens`` the most tokens all data together
    may hold (``--max-tokens-per-request``), counted before any datum is built.

    Raises InputError only when even the model id cannot be read; a bad datum (or too many
    tokens) is reported through ``error`` so the request still gets a future (and a clear
    failed result).
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
    tokens = sum(_declared_tokens(d) for d in msg.data)
    seq_id = None
    try:
        seq_id = check_seq_id(msg.seq_id or None)  # 0: the field's default, not sent
        if max_tokens is not None and tokens > max_tokens:
            raise InputError(f"forward_backward: {tokens} tokens in {len(msg.data)} datums; this server accepts at "
                             f"most {max_tokens} tokens per request (--max-tokens-per-request): send the data in "
                             f"smaller batches")
        limit = max_seq_len(msg.model_id)
        data = [_datum_from_proto(d, i, limit) for i, d in enumerate(msg.data)]
        if not data:
            raise InputError("forward_backward: no data (send at least one datum)")
    except InputError as exc:
        error = str(exc)
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=seq_id,
        loss_fn=msg.loss_fn or "cross_entropy",
        loss_fn_config=config or None,
        forward_only=bool(msg.forward_only),
        data=data,
        error=error,
        tokens=tokens,
    )


def _declared_tokens(msg: Any) -> int:
    """Positions a proto datum declares (its token bytes / 4, and its images' ``expected_tokens``),
    before anything is decoded."""
    total = 0
    for c in msg.model_input:
        kind = c.WhichOneof("chunk")
        if kind == "encoded_text":
            total += len(c.encoded_text.tokens) // 4
        elif kind == "image":
            total += c.image.expected_tokens
    return total


def _encoded_text_fields(msg: Any) -> dict[str, Any]:
    tokens = msg.tokens
    if len(tokens) % 4:
        raise InputError("token bytes are not a whole number of int32")
    return {"tokens": np.frombuffer(tokens, dtype=np.int32).astype(np.int64)}


#: a protobuf chunk kind's fields, as its class in ``types.model_input.CHUNK_TYPES`` takes them;
#: a kind not listed is read field by field as the message has them
PROTO_CHUNK_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {"encoded_text": _encoded_text_fields}


def _chunk_from_proto(msg: Any, what: str) -> Any:
    kind = msg.WhichOneof("chunk")
    inner = getattr(msg, kind) if kind else None
    read = PROTO_CHUNK_FIELDS.get(kind)
    try:
        fields = read(inner) if read is not None else {f.name: v for f, v in inner.ListFields()} if inner else {}
    except InputError as exc:
        raise InputError(f"{what}: {exc}") from None
    return chunk_from_fields({"type": kind, **fields}, what)


#: the fields of our Datum (a protobuf datum with any other field set is refused by name)
_DATUM_FIELDS = tuple(f.name for f in attrs.fields(Datum))


def _datum_from_proto(msg: Any, index: int, limit: int | None) -> Datum:
    refuse_unknown_keys(f"datum {index}", [f.name for f, _ in msg.ListFields()], _DATUM_FIELDS)
    length = _declared_tokens(msg)
    problem = sequence_length_problem(length, limit, source=SERVER_LIMIT)
    if problem:
        raise DatumError(problem, index=index)
    targets = msg.loss_fn_inputs["target_tokens"].shape[:1] if "target_tokens" in msg.loss_fn_inputs else [length]
    targets_length = int(targets[0]) if targets else 1
    for field, spans, positions in (("model_input_spans", msg.model_input_spans, length),
                                    ("loss_fn_input_spans", msg.loss_fn_input_spans, targets_length)):
        if (problem := span_count_problem(field, len(spans), positions)) is not None:
            raise DatumError(problem, index=index)  # from the counts, before a span is built
    try:
        chunks = [_chunk_from_proto(chunk, f"model_input.chunks[{j}]") for j, chunk in enumerate(msg.model_input)]
    except InputError as exc:
        raise DatumError(str(exc), index=index) from None
    inputs = {}
    for key, tensor in msg.loss_fn_inputs.items():
        try:
            inputs[key] = tensor_from_proto(tensor, max_elements=max(length, 1) * MAX_VALUES_PER_POSITION)
        except InputError as exc:
            raise DatumError(str(exc), index=index, key=key) from None
    try:
        return Datum(model_input=ModelInput(chunks), loss_fn_inputs=inputs,
                     model_input_spans=_spans_from_proto(msg.model_input_spans),
                     loss_fn_input_spans=_spans_from_proto(msg.loss_fn_input_spans))
    except DatumError:
        raise
    except InputError as exc:
        raise DatumError(str(exc), index=index) from None


#: a ``ProvenanceSpan``'s oneof arm -> the span ``kind`` (``types.provenance``)
_SPAN_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}


def _spans_from_proto(spans: Any) -> list[dict[str, Any]] | None:
    """Repeated ``ProvenanceSpan`` messages as span mappings (none sent: no provenance)."""
    out = []
    for span in spans:
        arm = span.WhichOneof("span")
        inner = getattr(span, arm) if arm else None
        out.append({"kind": _SPAN_KINDS.get(arm, arm), "sequence_id": inner.sequence_id if inner else "",
                    "length": inner.length if inner else 0, "offset": inner.offset if inner else 0})
    return out or None


def tensor_from_proto(msg: Any, max_elements: int | None = None) -> np.ndarray:
    """A proto ``Tensor`` (dense or sparse CSR) as a dense numpy array; a declared shape of
    more than ``max_elements`` values is refused before anything is allocated."""
    np_dtype = _PROTO_TO_NUMPY.get(msg.dtype)
    if np_dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype
        raise InputError(f"unsupported tensor dtype {name}")
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape):
        raise InputError(f"negative tensor shape {shape}")
    if max_elements is not None and math.prod(shape) > max_elements:
        raise InputError(f"tensor shape {shape} declares {math.prod(shape)} values; at most {max_elements} "
                         f"({MAX_VALUES_PER_POSITION} per token of the datum) are accepted")
    encoding = msg.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, np_dtype, "sparse values")
        crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), "sparse crow_indices")
        cols = _frombuffer(csr.col_indices, np.dtype(np.int64), "sparse col_indices")
        dtype: TensorDtype = "int64" if np_dtype.kind in "iu" else "float32"
        return densify_csr(values, crow, cols, shape, dtype)
    array = _frombuffer(msg.dense if encoding == "dense" else b"", np_dtype, "tensor data")
    if shape:
        if math.prod(shape) != array.size:
            raise InputError(f"tensor shape {shape} does not match its {array.size} values")
        array = array.reshape(shape)
    return array


def _frombuffer(data: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise InputError(f"{what}: {len(data)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(data, dtype=dtype).copy()
