"""Tinker's protobuf messages <-> skyrl-sdk types: the forward_backward request and output,
and the sampling response.

The schema is the one shipped inside the ``tinker`` package
(``tinker.proto.tinker_public_pb2``); nothing here re-types it. Declared sizes are checked
against the model's sequence limit before anything is allocated from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from ..errors import DatumError, InputError, quoted
from ..types import Datum, EncodedTextChunk, ForwardBackwardOutput, ModelInput, SampleOutput, densify_csr

_PROTO_TO_NUMPY = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}
_NUMPY_TO_PROTO = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}
#: most values per position a loss input may declare (e.g. top-K targets: K <= this)
MAX_VALUES_PER_POSITION = 1024


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
    #: tokens of all its data (what the executor's turns count)
    tokens: int = 0


def parse_forward_backward(body: bytes, max_seq_len: Callable[[str], int | None],
                           max_tokens: int | None = None) -> FwdBwdRequest:
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
    tokens = sum(len(c.encoded_text.tokens) // 4 for d in msg.data for c in d.model_input
                 if c.WhichOneof("chunk") == "encoded_text")
    try:
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
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id if msg.seq_id > 0 else None,
        loss_fn=msg.loss_fn or "cross_entropy",
        loss_fn_config=config or None,
        forward_only=bool(msg.forward_only),
        data=data,
        error=error,
        tokens=tokens,
    )


def _datum_from_proto(msg: Any, index: int, limit: int | None) -> Datum:
    length = sum(len(c.encoded_text.tokens) // 4 for c in msg.model_input if c.WhichOneof("chunk") == "encoded_text")
    if limit is not None and length > limit:
        raise DatumError(f"model_input has {length} tokens; this model accepts at most {limit}", index=index)
    chunks = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise DatumError(f"model_input chunk {j} is a {quoted(kind)} chunk; only encoded_text is supported",
                             index=index)
        tokens = chunk.encoded_text.tokens
        if len(tokens) % 4:
            raise DatumError(f"model_input chunk {j}: token bytes are not a whole number of int32", index=index)
        chunks.append(EncodedTextChunk(np.frombuffer(tokens, dtype=np.int32).astype(np.int64)))
    inputs = {}
    for key, tensor in msg.loss_fn_inputs.items():
        try:
            inputs[key] = tensor_from_proto(tensor, max_elements=max(length, 1) * MAX_VALUES_PER_POSITION)
        except InputError as exc:
            raise DatumError(str(exc), index=index, key=key) from None
    try:
        return Datum(model_input=ModelInput(chunks), loss_fn_inputs=inputs)
    except DatumError:
        raise
    except InputError as exc:
        raise DatumError(str(exc), index=index) from None


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
#: an empty top-k cell on the wire (``tinker.types.topk_logprobs``: token 0, this logprob)
TOPK_EMPTY_LOGPROB = -99999.0


def sample_output_to_proto(out: SampleOutput, last_n: int | None = None, topk: int = 0) -> bytes:
    """Our output as a protobuf ``SampleResponse``. ``last_n``: only the last n prompt
    positions are scored (earlier ones read as not computed, in both prompt-logprob fields);
    ``topk``: the top-k width asked for (the matrix's width when no row has pairs)."""
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
    if out.topk_prompt_logprobs is not None:
        _topk_to_proto(out.topk_prompt_logprobs, last_n, topk, msg.topk_prompt_logprobs)
    return msg.SerializeToString()


def _topk_to_proto(rows: list[list[tuple[int, float]] | None], last_n: int | None, width: int, msg: Any) -> None:
    """Rows of (token, logprob) pairs as Tinker's dense ``TopkLogprobs`` (n x k, row-major;
    a position not computed, or a short row's tail, is the empty cell)."""
    n, k = len(rows), max((len(r) for r in rows if r), default=width)
    ids = np.zeros((n, k), dtype=np.int32)
    lps = np.full((n, k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    first = 0 if last_n is None else n - last_n
    for i in range(first, n):
        if rows[i]:
            ids[i, : len(rows[i])] = [t for t, _ in rows[i]]
            lps[i, : len(rows[i])] = [lp for _, lp in rows[i]]
    msg.token_ids = ids.tobytes()
    msg.logprobs = lps.tobytes()
    msg.k = k
    msg.length = n
