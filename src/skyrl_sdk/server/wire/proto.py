"""Our outputs as Tinker's protobuf messages: the forward_backward output and the sampling
response (requests are read by :mod:`skyrl_sdk.inputs.tinker_proto`).

The schema is the one shipped inside the ``tinker`` package
(``tinker.proto.tinker_public_pb2``); nothing here re-types it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from ...types import ForwardBackwardOutput, SampleOutput, SampleRequest

_NUMPY_TO_PROTO = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}


# ---- forward_backward output ----------------------------------------------------------------
def forward_backward_output_to_proto(out: ForwardBackwardOutput) -> bytes:
    """Our output as a protobuf ``ForwardBackwardOutput`` (one ArrayRecord per run of
    consecutive datums whose fields share dtype and trailing shape).

    The arrays are the engine's own (``TensorData`` holds them as they came, int64 or
    float32, C-contiguous): their bytes are joined straight into the message, one copy."""
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = out.loss_fn_output_type or "ArrayRecord"
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    arrays = [{k: np.ascontiguousarray(v.array) for k, v in o.items()} for o in out.loss_fn_outputs]
    for group in _group_by_layout(arrays):
        record = msg.loss_fn_outputs.add()
        record.type_tag = "ArrayRecord"
        record.num_datums = len(group)
        for name, first in group[0].items():
            batched = record.fields[name]
            batched.dtype = _NUMPY_TO_PROTO[first.dtype]
            batched.trailing_shape.extend(first.shape[1:])
            parts = [d[name] for d in group]
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum([p.nbytes for p in parts], out=offsets[1:])
            batched.data = b"".join([p.data for p in parts])
            batched.offsets = offsets.tobytes()
    return msg.SerializeToString()


def _group_by_layout(arrays: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    groups: list[list[dict[str, np.ndarray]]] = []
    last = None
    for d in arrays:
        layout = tuple((k, v.dtype, v.shape[1:]) for k, v in d.items())
        if groups and layout == last:
            groups[-1].append(d)
        else:
            groups.append([d])
            last = layout
    return groups


# ---- sampling ---------------------------------------------------------------------------------
#: an empty top-k cell on the wire (``tinker.types.topk_logprobs``: token 0, this logprob)
TOPK_EMPTY_LOGPROB = -99999.0


def sample_output_to_proto(out: SampleOutput, last_n: int | None = None, request: SampleRequest | None = None,
                           *, topk: int | None = None) -> bytes:
    """Our output as a protobuf ``SampleResponse``. ``last_n``: only the last n prompt
    positions are scored (earlier ones read as not computed, in both prompt-logprob fields);
    the widths asked for (the matrices' widths when no row has pairs) come from ``request``,
    or ``topk`` for the prompt top-k. ``target_prompt_logprobs`` is answered dense."""
    prompt_k = topk if topk is not None else request.topk_prompt_logprobs if request is not None else 0
    sample_k = request.topk_sample_logprobs if request is not None else 0
    msg = pb.SampleResponse()
    for seq in out.sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _topk_to_proto(seq.topk_logprobs, None, sample_k, s.topk_sampled_logprobs)
    if out.target_prompt_logprobs is not None:
        _tensor_to_proto(out.target_prompt_logprobs, msg.target_prompt_logprobs)
    if out.prompt_alt_tokens is not None:
        _tensor_to_proto(out.prompt_alt_tokens.tokens, msg.prompt_alt_tokens.tokens)
        _tensor_to_proto(out.prompt_alt_tokens.logprobs, msg.prompt_alt_tokens.logprobs)
    if out.prompt_logprobs is not None:
        lps = [math.nan if v is None else float(v) for v in out.prompt_logprobs]
        if last_n is not None:
            lps = [math.nan] * (len(lps) - last_n) + lps[len(lps) - last_n:]
        msg.prompt_logprobs = np.asarray(lps, dtype=np.float32).tobytes()
    if out.topk_prompt_logprobs is not None:
        _topk_to_proto(out.topk_prompt_logprobs, last_n, prompt_k, msg.topk_prompt_logprobs)
    return msg.SerializeToString()


def _tensor_to_proto(array: np.ndarray, msg: Any) -> None:
    """A dense int64 / float32 array as a proto ``Tensor``."""
    array = np.ascontiguousarray(array, dtype=np.int64 if np.asarray(array).dtype.kind in "iub" else np.float32)
    msg.dtype = _NUMPY_TO_PROTO[array.dtype]
    msg.shape.extend(array.shape)
    msg.dense = array.tobytes()


def _topk_to_proto(rows: Sequence[list[tuple[int, float]] | None], last_n: int | None, width: int, msg: Any) -> None:
    """Rows of (token, logprob) pairs as Tinker's dense ``TopkLogprobs`` (n x k, row-major;
    a position not computed, or a short row's tail, is the empty cell)."""
    n, k = len(rows), max((len(r) for r in rows if r), default=width)
    ids = np.zeros((n, k), dtype=np.int32)
    lps = np.full((n, k), TOPK_EMPTY_LOGPROB, dtype=np.float32)
    first = 0 if last_n is None else n - last_n
    for i in range(first, n):
        if row := rows[i]:
            ids[i, : len(row)] = [t for t, _ in row]
            lps[i, : len(row)] = [lp for _, lp in row]
    msg.token_ids = ids.tobytes()
    msg.logprobs = lps.tobytes()
    msg.k = k
    msg.length = n
