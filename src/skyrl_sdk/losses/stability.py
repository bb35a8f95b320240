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
time; past ``max_tokens`` recorded tokens the least recently used sequences are dropped.
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
from ..types import Datum, SampledProvenanceSpan, SampledSequence, TensorData

#: how long a recorded sequence stays usable after sampling or its last use (Tinker: one day)
RECORD_TTL_S = 24 * 3600.0
#: recorded tokens (prompts counted once per sequence) kept per records object
MAX_RECORDED_TOKENS = 2**24
#: how far a datum's ``logprobs`` may be from the recorded ones at a sampled position
LOGPROB_TOLERANCE = 1e-3
#: the loss input resolution writes: 1.0 where the target is a sampled token (a datum must not bring its own)
SAMPLED_MASK = "sampled_mask"
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


class SequenceRecords:
    """Recorded sequences by id, bounded (``max_tokens``) and expiring (``ttl_s``); thread-safe
    (samplers record from their workers while a training request reads)."""

    def __init__(self, ttl_s: float = RECORD_TTL_S, max_tokens: int = MAX_RECORDED_TOKENS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.clock = clock
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, RecordedSequence] = collections.OrderedDict()
        self._tokens = 0
        #: sequences dropped to stay within ``max_tokens`` (reported in errors and tests)
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    @property
    def tokens(self) -> int:
        return self._tokens

    @staticmethod
    def new_ids(n: int) -> list[str]:
        """``n`` fresh sequence ids (one sampling request's)."""
        base = uuid.uuid4().hex
        return [f"seq-{base}:{i}" for i in range(n)]

    def record(self, prompt: np.ndarray, sequences: Sequence[SampledSequence], ids: Sequence[str]) -> None:
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
                old = self._records.pop(sid, None)
                self._tokens += rec.cost - (old.cost if old is not None else 0)
                self._records[sid] = rec
            while self._tokens > self.max_tokens and len(self._records) > 1:
                _, dropped = self._records.popitem(last=False)
                self._tokens -= dropped.cost
                self.evicted += 1

    def use(self, ids: Sequence[str]) -> dict[str, RecordedSequence]:
        """The records of ``ids``, each renewed for another ``ttl_s``; InputError naming the
        first id that is unknown, expired or dropped (nothing is renewed then)."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            found = {}
            for sid in ids:
                rec = self._records.get(sid)
                if rec is None:
                    raise InputError(
                        f"sequence_id {sid!r} names no recorded sequence: sample with record_stability_info=True "
                        f"in the same session; recorded sequences expire {self.ttl_s / 3600:g} h after sampling or "
                        f"their last use, and the oldest are dropped past {self.max_tokens} recorded tokens")
                found[sid] = rec
            for sid, rec in found.items():
                rec.expires_at = now + self.ttl_s
                self._records.move_to_end(sid)
            return found

    def _expire(self, now: float) -> None:
        dead = [sid for sid, rec in self._records.items() if rec.expires_at <= now]
        for sid in dead:
            self._tokens -= self._records.pop(sid).cost


def resolve_provenance(datums: Sequence[Datum], records: SequenceRecords) -> list[Datum]:
    """Check every datum's provenance against ``records`` and return the datums with the
    recorded sampler logprobs as ``logprobs`` and ``sampled_mask`` (1 where the target is a
    sampled token); the records used are renewed. Nothing is changed when a datum fails.

    Checked: the input tokens against every span, the targets against the sampled spans (the
    positions the loss trains), every span's range. A prompt span's targets are not compared:
    their advantage must be 0, so they train nothing, and tinker-cookbook's ``rl_loop`` recipe
    sends 0 there rather than the prompt's next token."""
    ids = sorted({s.sequence_id for d in datums for s in (d.model_input_spans or ()) + (d.loss_fn_input_spans or ())})
    for i, d in enumerate(datums):
        if d.model_input_spans is None:
            raise DatumError("this loss needs provenance (Datum.with_provenance naming the sampled sequences); "
                             "sample with record_stability_info=True and attach the sequence_ids", index=i)
        if SAMPLED_MASK in d.loss_fn_inputs:
            raise DatumError(f"{SAMPLED_MASK!r} is computed from the datum's provenance; do not send it", index=i)
    found = records.use(ids)
    return [_resolve(i, d, found) for i, d in enumerate(datums)]


def _claimed(span, rec: RecordedSequence, index: int, field: str) -> np.ndarray:
    """The recorded tokens a span claims (its prompt's or its sampled tokens' run)."""
    source = rec.tokens if isinstance(span, SampledProvenanceSpan) else rec.prompt
    what = "sampled tokens" if isinstance(span, SampledProvenanceSpan) else "prompt"
    if span.offset + span.length > source.size:
        raise DatumError(f"{field}: a span claims positions {span.offset}..{span.offset + span.length - 1} of the "
                         f"{what} of sequence {span.sequence_id!r}, which has {source.size}", index=index)
    return source[span.offset:span.offset + span.length]


def _check_run(index: int, field: str, span, actual: np.ndarray, claimed: np.ndarray, start: int) -> None:
    bad = np.flatnonzero(actual != claimed)
    if bad.size:
        p = int(bad[0])
        raise DatumError(f"{field}: position {start + p} is token {int(actual[p])} but the span names token "
                         f"{int(claimed[p])} of sequence {span.sequence_id!r}", index=index)


def _resolve(index: int, d: Datum, found: dict[str, RecordedSequence]) -> Datum:
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
