"""StableReinforce's stability information: the sampled sequences a sampler recorded, and a
datum's provenance checked and resolved against them.

A sampler asked to ``record_stability_info`` keeps, per sampled sequence, its prompt, its
tokens and the sampler's logprob of each token, under the sequence's ``sequence_id``
(:class:`SequenceRecords`). A training datum names those sequences through its provenance
spans; :func:`resolve_provenance` checks every claim (the datum's tokens are the recorded
tokens at the positions named) and gives the loss the *recorded* sampler logprobs and which
targets were sampled. So the loss compares the learner with the sampler that really drew
the tokens, whatever the client sends.

Bounded and expiring as Tinker documents: a recorded sequence can be trained on for
``ttl_s`` (a day) after sampling, and each training request that uses it restarts that
time; past ``max_tokens`` recorded tokens (or ``max_bytes``) the least recently used
sequences are dropped. Several scopes can share one bound: :meth:`SequenceRecords.scope`
gives a view whose ids are its own (the server gives each client session one, all of an
owner's sessions sharing the owner's records, so the bound spans them), and
:meth:`ScopedRecords.close` drops a view's sequences and refuses new ones (its session ended).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from ..errors import DatumError, InputError
from ..types import Datum, ProvenanceSpan, SampledProvenanceSpan, SampledSequence, SampleOutput, TensorData
from .base import check_finite_inputs

#: how long a recorded sequence stays usable after sampling or its last use (Tinker: one day)
RECORD_TTL_S = 24 * 3600.0
#: recorded tokens (prompts counted once per sequence) kept per records object
MAX_RECORDED_TOKENS = 2**24
#: how far a datum's ``logprobs`` may be from the recorded ones at a sampled position
LOGPROB_TOLERANCE = 1e-3
#: the loss input resolution writes: 1.0 where the target is a sampled token (a datum must not bring its own)
SAMPLED_MASK = "sampled_mask"
#: what one recorded sequence costs besides its arrays (its record, its key, its dict entry)
RECORD_OVERHEAD_BYTES = 512
#: every loss input resolution writes, and what a caller should know of it
COMPUTED_INPUTS = {
    "logprobs": "the recorded sampler logprobs replace it; if sent, it must match them within "
                f"{LOGPROB_TOLERANCE:g} at sampled positions",
    SAMPLED_MASK: "computed from the datum's provenance (1 where the target is a sampled token)",
}


@attrs.define(eq=False)
class RecordedSequence:
    """One sampled sequence: its request's prompt, its tokens and their sampler logprobs."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    expires_at: float

    @property
    def cost(self) -> int:
        return int(self.prompt.size + self.tokens.size)

    @property
    def nbytes(self) -> int:
        """Bytes it holds (its prompt counted whole, though the samples of one prompt share it)."""
        return int(self.prompt.nbytes + self.tokens.nbytes + self.logprobs.nbytes) + RECORD_OVERHEAD_BYTES


#: a record's key: (scope, sequence id); scope None for ids used directly
_Key = tuple[object, str]


def new_request_id() -> str:
    """A fresh id for one prompt's sample request, of the form the server gives its requests."""
    return f"sample-{uuid.uuid4().hex}"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ``sequence_id`` of each of a sample request's ``n`` sequences: ``<request_id>:<i>``
    (the server answers them with the request, before sampling: Tinker's ``sample_sequence_ids``)."""
    return [f"{request_id}:{i}" for i in range(n)]


class SequenceRecords:
    """Recorded sequences by id, bounded (``max_tokens`` recorded tokens, ``max_bytes`` bytes)
    and expiring (``ttl_s``); thread-safe (samplers record from their workers while a training
    request reads)."""

    def __init__(self, ttl_s: float = RECORD_TTL_S, max_tokens: int = MAX_RECORDED_TOKENS,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[_Key, RecordedSequence] = collections.OrderedDict()
        self._tokens = 0
        self._bytes = 0
        #: sequences dropped to stay within the bounds (reported in errors and tests)
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    @property
    def tokens(self) -> int:
        return self._tokens

    def record_outputs(self, prompts: Sequence[np.ndarray], outs: Sequence[SampleOutput],
                       request_ids: Sequence[str] | None = None) -> list[SampleOutput]:
        """Record each prompt's sampled sequences (the one way they are recorded, in process and
        in the server) under :func:`sequence_ids` of its request id (``request_ids``: one per
        prompt, the server's; by default :func:`new_request_id`), and return the outputs with
        each sequence carrying its ``sequence_id``."""
        return _record_outputs(self.record, prompts, outs, request_ids)

    @property
    def nbytes(self) -> int:
        """Bytes the records hold (what ``max_bytes`` bounds)."""
        return self._bytes

    def scope(self, name: object) -> ScopedRecords:
        """A view of these records whose ids are its own, within these records' bounds."""
        return ScopedRecords(self, name)

    def record(self, prompt: np.ndarray, sequences: Sequence[SampledSequence], ids: Sequence[str],
               scope: object = None) -> None:
        """Record the samples of one prompt under ``ids`` (one per sequence)."""
        if len(ids) != len(sequences):
            raise ValueError(f"{len(ids)} sequence ids for {len(sequences)} sequences")
        prompt = np.asarray(prompt, dtype=np.int64).copy()
        now = self.clock()
        with self._lock:
            self._expire(now)
            for sid, seq in zip(ids, sequences, strict=True):
                rec = RecordedSequence(prompt, np.asarray(seq.tokens, dtype=np.int64),
                                       np.asarray(seq.logprobs, dtype=np.float32), now + self.ttl_s)
                self._pop((scope, sid))
                self._records[scope, sid] = rec
                self._tokens += rec.cost
                self._bytes += rec.nbytes
            while len(self._records) > 1 and (self._tokens > self.max_tokens or (
                    self.max_bytes is not None and self._bytes > self.max_bytes)):
                self._pop(next(iter(self._records)))
                self.evicted += 1

    def use(self, ids: Sequence[str], scope: object = None) -> dict[str, RecordedSequence]:
        """The records of ``ids``, each renewed for another ``ttl_s``; InputError naming the
        first id that is unknown, expired or dropped (nothing is renewed then)."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            found = {}
            for sid in ids:
                rec = self._records.get((scope, sid))
                if rec is None:
                    bound = f"{self.max_tokens} recorded tokens" + (
                        f" or {self.max_bytes} bytes" if self.max_bytes is not None else "")
                    raise InputError(
                        f"sequence_id {sid!r} names no recorded sequence: sample with record_stability_info=True "
                        f"in the same session; recorded sequences expire {self.ttl_s / 3600:g} h after sampling or "
                        f"their last use, and the oldest are dropped past {bound}")
                found[sid] = rec
            for sid, rec in found.items():
                rec.expires_at = now + self.ttl_s
                self._records.move_to_end((scope, sid))
            return found

    def drop(self, scope: object) -> int:
        """Forget every sequence of ``scope``; how many there were."""
        with self._lock:
            keys = [key for key in self._records if key[0] == scope]
            for key in keys:
                self._pop(key)
            return len(keys)

    def _pop(self, key: _Key) -> None:
        rec = self._records.pop(key, None)
        if rec is not None:
            self._tokens -= rec.cost
            self._bytes -= rec.nbytes

    def _expire(self, now: float) -> None:
        for key in [key for key, rec in self._records.items() if rec.expires_at <= now]:
            self._pop(key)


class ScopedRecords:
    """One scope of a :class:`SequenceRecords` (a client session's recorded sequences): the
    same methods, its own ids, the shared bounds. Once :meth:`close` d it records nothing more
    (a sample that finishes after its session ended is dropped) and names no sequence."""

    def __init__(self, records: SequenceRecords, name: object) -> None:
        self.records, self.name = records, name
        self.closed = False
        self._lock = threading.Lock()  # a record and the close never interleave

    def record_outputs(self, prompts: Sequence[np.ndarray], outs: Sequence[SampleOutput],
                       request_ids: Sequence[str] | None = None) -> list[SampleOutput]:
        """:meth:`SequenceRecords.record_outputs`, through this view's :meth:`record`."""
        return _record_outputs(self.record, prompts, outs, request_ids)

    def __len__(self) -> int:
        with self.records._lock:
            return sum(key[0] == self.name for key in self.records._records)

    def record(self, prompt: np.ndarray, sequences: Sequence[SampledSequence], ids: Sequence[str]) -> None:
        with self._lock:
            if not self.closed:
                self.records.record(prompt, sequences, ids, self.name)

    def use(self, ids: Sequence[str]) -> dict[str, RecordedSequence]:
        return self.records.use(ids, self.name)

    def close(self) -> None:
        """Drop this scope's sequences, and refuse new ones from now on."""
        with self._lock:
            self.closed = True
            self.records.drop(self.name)


#: what a Backend records into and provenance reads: the records, or one session's scope of them
Records = SequenceRecords | ScopedRecords


def _record_outputs(record: Callable[[np.ndarray, Sequence[SampledSequence], Sequence[str]], None],
                    prompts: Sequence[np.ndarray], outs: Sequence[SampleOutput],
                    request_ids: Sequence[str] | None) -> list[SampleOutput]:
    """``record_outputs`` of records or of a scope of them (``record``: theirs)."""
    ids = list(request_ids) if request_ids is not None else [new_request_id() for _ in prompts]
    recorded = []
    for prompt, out, request_id in zip(prompts, outs, ids, strict=True):
        seq_ids = sequence_ids(request_id, len(out.sequences))
        record(prompt, out.sequences, seq_ids)
        recorded.append(attrs.evolve(out, sequences=[attrs.evolve(s, sequence_id=i)
                                                     for s, i in zip(out.sequences, seq_ids, strict=True)]))
    return recorded


def resolve_provenance(datums: Sequence[Datum], records: Records) -> list[Datum]:
    """Check every datum's provenance against ``records`` and return the datums with the
    recorded sampler logprobs as ``logprobs`` and ``sampled_mask`` (1 where the target is a
    sampled token); the records used are renewed. Nothing is changed when a datum fails.

    Checked: the input tokens against every span, the targets against the sampled spans (the
    positions the loss trains), every span's range. A prompt span's targets are not compared:
    their advantage must be 0, so they train nothing, and tinker-cookbook's ``rl_loop`` recipe
    sends 0 there rather than the prompt's next token."""
    ids = sorted({s.sequence_id for d in datums for s in (d.model_input_spans or ()) + (d.loss_fn_input_spans or ())})
    for i, d in enumerate(datums):
        check_finite_inputs(d, i)  # what the datum sends is checked before it is compared or replaced
        if d.model_input_spans is None:
            raise DatumError("this loss needs provenance (Datum.with_provenance naming the sampled sequences); "
                             "sample with record_stability_info=True and attach the sequence_ids", index=i)
        if SAMPLED_MASK in d.loss_fn_inputs:
            raise DatumError(f"{SAMPLED_MASK!r} is computed from the datum's provenance; do not send it", index=i)
    found = records.use(ids)
    return [_resolve(i, d, found) for i, d in enumerate(datums)]


def _claimed(span: ProvenanceSpan, rec: RecordedSequence, index: int, field: str) -> np.ndarray:
    """The recorded tokens a span claims (its prompt's or its sampled tokens' run)."""
    source = rec.tokens if isinstance(span, SampledProvenanceSpan) else rec.prompt
    what = "sampled tokens" if isinstance(span, SampledProvenanceSpan) else "prompt"
    if span.offset + span.length > source.size:
        raise DatumError(f"{field}: a span claims positions {span.offset}..{span.offset + span.length - 1} of the "
                         f"{what} of sequence {span.sequence_id!r}, which has {source.size}", index=index)
    return source[span.offset:span.offset + span.length]


def _check_run(index: int, field: str, span: ProvenanceSpan, actual: np.ndarray, claimed: np.ndarray,
               start: int) -> None:
    bad = np.flatnonzero(actual != claimed)
    if bad.size:
        p = int(bad[0])
        raise DatumError(f"{field}: position {start + p} is token {int(actual[p])} but the span names token "
                         f"{int(claimed[p])} of sequence {span.sequence_id!r}", index=index)


def _resolve(index: int, d: Datum, found: dict[str, RecordedSequence]) -> Datum:
    assert d.model_input_spans is not None and d.loss_fn_input_spans is not None  # refused above without provenance
    tokens = d.model_input.to_numpy()
    pos = 0
    for span in d.model_input_spans:
        run = _claimed(span, found[span.sequence_id], index, "model_input_spans")
        _check_run(index, "model_input_spans", span, tokens[pos:pos + span.length], run, pos)
        pos += span.length
    targets_td = d.loss_fn_inputs.get("target_tokens")
    if targets_td is None or len(targets_td.shape) != 1:
        raise DatumError("expected 1-D target_tokens (one per position) with provenance", index=index)
    targets = targets_td.to_numpy()
    q = np.zeros(targets.size, dtype=np.float32)
    sampled = np.zeros(targets.size, dtype=np.float32)
    pos = 0
    for span in d.loss_fn_input_spans:
        rec = found[span.sequence_id]
        run = _claimed(span, rec, index, "loss_fn_input_spans")
        if isinstance(span, SampledProvenanceSpan):  # a prompt run's targets train nothing (advantage 0, below):
            # tinker-cookbook's recipes/rl_loop.py sends 0 there, so only the sampled targets must be the recorded ones
            _check_run(index, "loss_fn_input_spans", span, targets[pos:pos + span.length], run, pos)
            q[pos:pos + span.length] = rec.logprobs[span.offset:span.offset + span.length]
            sampled[pos:pos + span.length] = 1.0
        pos += span.length
    inputs = dict(d.loss_fn_inputs)
    adv = inputs.get("advantages")
    if adv is not None:
        off = np.flatnonzero((adv.to_numpy() != 0) & (sampled == 0))
        if off.size:
            raise DatumError(f"position {int(off[0])} has a nonzero advantage but is not a sampled token (its "
                             f"provenance is a prompt span); advantages belong on sampled tokens only",
                             index=index, key="advantages")
    sent = inputs.get("logprobs")
    if sent is not None:
        diff = np.abs(sent.to_numpy() - q) * sampled
        if diff.size and float(diff.max()) > LOGPROB_TOLERANCE:
            p = int(diff.argmax())
            raise DatumError(f"position {p}: logprob {float(sent.to_numpy()[p])} differs from the recorded sampler "
                             f"logprob {float(q[p])} of the sequence its provenance names", index=index,
                             key="logprobs")
    inputs["logprobs"] = TensorData(q)
    inputs[SAMPLED_MASK] = TensorData(sampled)
    return attrs.evolve(d, loss_fn_inputs=inputs)
