"""What a client may make the server keep: ``user_metadata`` and tags bounded in size, open
sessions bounded per owner, AdamParams a float32 step can hold; each refused up front with a
user error naming the field and the cap, nothing stored or changed."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, next_token_datum, raw_client, wait_result
from skyrl_sdk.server.wire.caps import MAX_METADATA_BYTES, MAX_TAGS

ALICE, BOB = "tml-alice-key", "tml-bob-key"
OPEN = 3


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), api_key=None, api_keys={ALICE: "alice", BOB: "bob"},
                      max_sessions_per_owner=OPEN) as server:
        yield server


def _big(extra: int = 1) -> dict:
    """A metadata object whose compact JSON is MAX_METADATA_BYTES + extra - 1 bytes."""
    return {"k": "x" * (MAX_METADATA_BYTES - 8 + extra)}


def _user_error(http, answer: dict) -> str:
    doc = wait_result(http, answer["request_id"]).json()
    assert doc["category"] == "user", doc
    return doc["error"]


def test_metadata_and_tags_are_bounded_wherever_they_are_stored(srv):
    """Before: 3 MB of metadata per session was accepted (and kept in SQLite)."""
    with raw_client(srv, ALICE) as http:
        r = http.post("/api/v1/create_session", json={"user_metadata": _big()})
        assert r.status_code == 400 and f"keeps at most {MAX_METADATA_BYTES}" in r.json()["detail"]
        assert r.json()["detail"].startswith("user_metadata: ")
        r = http.post("/api/v1/create_session", json={"tags": ["t"] * (MAX_TAGS + 1)})
        assert r.status_code == 400 and f"at most {MAX_TAGS}" in r.json()["detail"]
        assert http.get("/api/v1/sessions").json()["sessions"] == []  # nothing was stored
        sid = http.post("/api/v1/create_session", json={"user_metadata": _big(0)}).json()["session_id"]  # at the cap
        says = _user_error(http, http.post("/api/v1/create_model", json={
            "session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2},
            "user_metadata": _big()}).json())
        assert says.startswith("user_metadata: ") and str(MAX_METADATA_BYTES) in says
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 1, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        model_id = wait_result(http, fut["request_id"]).json()["model_id"]
        says = _user_error(http, http.post("/api/v1/save_weights", json={
            "model_id": model_id, "path": "big", "user_metadata": _big()}).json())
        assert says.startswith("user_metadata: ")
        assert http.get("/api/v1/checkpoints").json()["checkpoints"] == []
        http.post(f"/api/v1/sessions/{sid}/finish", json={})


def test_open_sessions_are_bounded_per_owner(srv):
    """Before: unbounded. The cap counts open sessions of one owner; finishing one frees a place,
    and another owner is not affected."""
    with raw_client(srv, ALICE) as alice, raw_client(srv, BOB) as bob:
        sids = [alice.post("/api/v1/create_session", json={}).json()["session_id"] for _ in range(OPEN)]
        refused = alice.post("/api/v1/create_session", json={})
        assert refused.status_code == 400 and f"at most {OPEN} per owner" in refused.json()["detail"]
        assert bob.post("/api/v1/create_session", json={}).status_code == 200
        alice.post(f"/api/v1/sessions/{sids[0]}/finish", json={})
        assert alice.post("/api/v1/create_session", json={}).status_code == 200
        for sid in alice.get("/api/v1/sessions").json()["sessions"]:
            alice.post(f"/api/v1/sessions/{sid}/finish", json={})
        for sid in bob.get("/api/v1/sessions").json()["sessions"]:
            bob.post(f"/api/v1/sessions/{sid}/finish", json={})


def test_adam_params_a_float32_step_cannot_hold_are_refused_and_the_gradients_kept(srv):
    """Before: learning_rate=1e39 was accepted, the step skipped as non-finite, and the pending
    gradients cleared. Now a user error naming the field; the next step uses those gradients."""
    service = srv.service_client(api_key=ALICE)
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    tc.forward_backward([next_token_datum(6)], "cross_entropy").result()
    with raw_client(srv, ALICE) as http:
        for value in (1e39, 1e-40):
            says = _user_error(http, http.post("/api/v1/optim_step", json={
                "model_id": tc.model_id, "adam_params": {"learning_rate": value}}).json())
            assert "AdamParams.learning_rate: expected 0 or a magnitude in" in says
    metrics = tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics
    assert metrics["skipped"] == 0.0 and metrics["step"] == 1.0 and np.isfinite(metrics["grad_norm"]) \
        and metrics["grad_norm"] > 0  # the gradients of the forward_backward above were still there
    service.close("success").result()
