"""stable_reinforce through the tinker client: sequences recorded by a sampling client of the
session, datums with provenance, loss_fn_config_v2 values (a number and a text), and the
provenance checks over HTTP (a failed future naming the datum; another session's sequences
are not this session's)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, raw_client

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as server:
        yield server


def datum_of(sequence, advantage: float) -> tt.Datum:
    """The cookbook's layout (recipes/rl_loop.py): prompt + sampled tokens shifted by one."""
    full, n, sid = PROMPT + list(sequence.tokens), len(sequence.tokens), sequence.sequence_id
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "logprobs": [0.0] * (len(PROMPT) - 1) + list(sequence.logprobs),
        "advantages": [0.0] * (len(PROMPT) - 1) + [advantage] * n})
    return datum.with_provenance(
        model_input=[tt.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                     tt.SampledProvenanceSpan(sequence_id=sid, length=n - 1)],
        loss_fn_inputs=[tt.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(PROMPT) - 1),
                        tt.SampledProvenanceSpan(sequence_id=sid, length=n)])


def recorded(client, n=3):
    out = client.sample(tt.ModelInput.from_ints(PROMPT), n, tt.SamplingParams(max_tokens=5, seed=3))
    return out.result(timeout=HANG_S).sequences


def test_stable_reinforce_through_the_client(srv):
    service = srv.service_client()
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result(timeout=HANG_S)
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=HANG_S)
    sequences = recorded(sampler)
    advantages = [1.0, -0.5, -0.5]
    data = [datum_of(s, a) for s, a in zip(sequences, advantages, strict=True)]
    # a number (kl_coeff, in both config maps) and a text (loss_reduction: loss_fn_config_v2 only)
    out = trainer.forward_backward(data, "stable_reinforce",
                                   {"kl_coeff": 0.2, "loss_reduction": "token_mean"}).result(timeout=HANG_S)
    tokens = sum(len(s.tokens) for s in sequences)
    positions = sum(d.model_input.length for d in data)  # token_mean's denominator: every position (no weights)
    # on policy the weight is 1 and the value is -A per sampled token
    want = -sum(a * len(s.tokens) for s, a in zip(sequences, advantages, strict=True)) / positions
    assert out.metrics["loss:sum"] == pytest.approx(want, abs=1e-4)
    assert out.metrics["weight_max:max"] == pytest.approx(1.0, abs=1e-4)
    assert out.metrics["num_loss_tokens:sum"] == tokens
    assert trainer.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=HANG_S).metrics["grad_norm"] > 0

    # the learner moved: the same recorded sequences are now off policy, and still resolve
    stale = trainer.forward_backward(data, "stable_reinforce").result(timeout=HANG_S)
    assert stale.metrics["ratio_max:max"] != pytest.approx(1.0, abs=1e-4)
    weights = [o["importance_weight"].to_numpy() for o in stale.loss_fn_outputs]
    assert max(float(w.max()) for w in weights) <= 2.0

    bad = data[0].loss_fn_inputs["target_tokens"].to_numpy().copy()
    bad[-1] = (bad[-1] + 1) % 300
    tampered = tt.Datum(model_input=data[0].model_input, loss_fn_inputs={**data[0].loss_fn_inputs, "target_tokens": bad},
                        model_input_spans=data[0].model_input_spans, loss_fn_input_spans=data[0].loss_fn_input_spans)
    with pytest.raises(tinker.RequestFailedError, match=r"datum 1: loss_fn_input_spans: position \d+ is token"):
        trainer.forward_backward([data[1], tampered], "stable_reinforce").result(timeout=HANG_S)
    with pytest.raises(tinker.RequestFailedError, match="datum 0: this loss needs provenance"):
        trainer.forward_backward([tt.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)],
                                 "stable_reinforce").result(timeout=HANG_S)

    other = srv.service_client()  # another session of the same owner
    theirs = recorded(other.create_sampling_client(base_model="tiny", record_stability_info=True)
                      .result(timeout=HANG_S), n=1)
    with pytest.raises(tinker.RequestFailedError, match="names no recorded sequence"):
        trainer.forward_backward([datum_of(theirs[0], 1.0)], "stable_reinforce").result(timeout=HANG_S)
    assert np.isfinite(trainer.forward_backward(data, "stable_reinforce").result(timeout=HANG_S).metrics["loss:sum"])
    session_id = service.holder.get_session_id()
    assert session_id in srv.runtime.recorded.sessions
    other.close("success").result()
    service.close("success").result()
    assert session_id not in srv.runtime.recorded.sessions  # gone with the session


def test_recorded_sequences_end_with_their_session(srv):
    """Issue 41, item 4. Before: after ``POST /sessions/{id}/finish`` a sampling client of that
    session still recorded sequences (400 of them grew the server by 23.6 MB) and nothing freed
    them. Now recording for an ended session is refused by name, its sequences are gone."""
    service = srv.service_client()
    sampler = service.create_sampling_client(base_model="tiny", record_stability_info=True).result(timeout=HANG_S)
    assert recorded(sampler)
    session_id = service.holder.get_session_id()
    with raw_client(srv) as http:  # the finish as a client of its own sends it (the client stays open)
        http.post(f"/api/v1/sessions/{session_id}/finish", json={}).raise_for_status()
    with pytest.raises(tinker.RequestFailedError, match=f"record_stability_info: session {session_id} was finished"):
        recorded(sampler)
    assert session_id not in srv.runtime.recorded.sessions
    assert sum(len(r) for r in srv.runtime.recorded.owners.values()) == 0


def test_recorded_sequences_are_bounded_per_owner_across_its_sessions(tmp_path):
    """Issue 41, item 4. Before: no bound spanned an owner's sessions (each of its up to 256
    sessions had its own 2**24 tokens). Now one byte bound covers all of an owner's sessions
    (here 40 KB: the oldest sequences of the owner go first, whichever session recorded them)."""
    with ServerThread(tmp_path / "state", max_recorded_bytes=40_000) as srv:
        prompt = [1 + i % 300 for i in range(400)]  # ~3.2 KB of prompt per recorded sequence
        sessions = [srv.service_client() for _ in range(3)]
        samplers = [s.create_sampling_client(base_model="tiny", record_stability_info=True).result(timeout=HANG_S)
                    for s in sessions]
        for _ in range(3):
            for client in samplers:
                client.sample(tt.ModelInput.from_ints(prompt), 2, tt.SamplingParams(max_tokens=2, seed=1)
                              ).result(timeout=HANG_S)
        (owner_records,) = srv.runtime.recorded.owners.values()
        assert 0 < owner_records.nbytes <= 40_000 and owner_records.evicted > 0
        kept = [len(srv.runtime.recorded.sessions[s.holder.get_session_id()]) for s in sessions]
        assert kept[0] < kept[-1]  # the first session's, the oldest, went first
        for client in sessions:
            client.close("success").result()
        assert owner_records.nbytes == 0


def test_kl_coef_through_the_client_names_the_losses_own_kl_coeff(srv):
    """Through the tinker client, too: ``{"kl_coef": 0.1}`` (every loss's KL term to a reference,
    which needs ref_logprobs) fails naming stable_reinforce's own ``kl_coeff``; that one trains."""
    from skyrl_sdk.rl import tinker_datum_from_sample

    service = srv.service_client()
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result(timeout=HANG_S)
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=HANG_S)
    data = [tinker_datum_from_sample(PROMPT, s, a) for s, a in zip(recorded(sampler, 2), [1.0, -1.0], strict=True)]
    with pytest.raises(tinker.RequestFailedError, match="did you mean this loss's own 'kl_coeff'"):
        trainer.forward_backward(data, "stable_reinforce", {"kl_coef": 0.1}).result(timeout=HANG_S)
    out = trainer.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result(timeout=HANG_S)
    assert np.isfinite(out.metrics["loss:sum"])
    service.close("success").result()
