"""What the guard decides from a request's line and headers alone: the documented 16 KiB head
limit, /healthz answered there (no route, no SQLite, no compute), integers in the query that
SQLite cannot hold, the security headers every answer carries, and the names a server without
keys answers (``--allowed-host``). Also: the console's curves, read on one thread and cached."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from _limits import HANG_S
from _server_harness import API_KEY, ServerThread, raw_client, wait_result
from skyrl_sdk.server.http.guard import MAX_HEADER_BYTES


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as server:
        yield server


def _raw(srv, request: bytes) -> bytes:
    """``request`` sent in one write on a new connection; the whole answer (head and body)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=HANG_S) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer and (piece := s.recv(1 << 16)):
            answer += piece
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), b"0"))
        while len(body) < length and (piece := s.recv(1 << 16)):
            body += piece
        return head + b"\r\n\r\n" + body


def test_request_heads_over_16_kib_are_refused_whole_or_in_pieces(srv):
    """Before: a 64 KiB head sent in one write was served (h11 limits only heads in pieces)."""
    def head(size: int) -> bytes:
        return f"GET /api/v1/sessions HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nX-Pad: {'a' * size}\r\n\r\n".encode()

    assert _raw(srv, head(MAX_HEADER_BYTES - 200)).startswith(b"HTTP/1.1 200")
    for size in (MAX_HEADER_BYTES, 64 * 1024):
        answer = _raw(srv, head(size))
        assert answer.startswith(b"HTTP/1.1 431") and b"16384 bytes" in answer, size


@pytest.mark.parametrize("path", [
    "/console/api/runs?offset=100000000000000000000000", "/console/api/runs?limit=-100000000000000000000000",
    "/api/v1/training_runs?offset=100000000000000000000000", "/api/v1/checkpoints?limit=9223372036854775808",
    "/api/v1/sessions?offset=" + "9" * 5000,
    # issue 41, item 14: what the web framework's int parser rounded or read past int64
    "/api/v1/checkpoints?offset=9_223_372_036_854_775_808", "/api/v1/training_runs?offset=99999999999999999999.0",
    "/api/v1/sessions?offset=9_223_372_036_854_775_808", "/console/api/runs?offset=99999999999999999999.0",
    "/api/v1/checkpoints?limit=20.0", "/console/api/runs?limit=1e3",
])
def test_query_integers_outside_int64_are_400_naming_them(srv, path):
    """Before: offset=10**23 was a 500 (SQLite's OverflowError) where limit got a 400; an offset
    written with underscores or as a decimal passed the guard and was a 500 again."""
    with raw_client(srv) as http:
        r = http.get(path)
    name = path.split("?")[1].split("=")[0]
    assert r.status_code == 400 and f"query parameter {name!r}: expected an integer in" in r.json()["detail"]
    assert len(r.text) < 400  # a 5000-digit value is not echoed


@pytest.mark.parametrize("path", [
    "/api/v1/training_runs?limit=-1", "/api/v1/training_runs?offset=-5", "/api/v1/checkpoints?limit=1001",
    "/api/v1/checkpoints?offset=-1", "/api/v1/sessions?limit=-1", "/console/api/runs?offset=-1",
])
def test_listing_pages_out_of_range_are_400_naming_the_parameter(srv, path):
    """Before: a negative limit or offset of the catalog listings was silently taken as 0."""
    with raw_client(srv) as http:
        r = http.get(path)
        assert http.get(path.split("?")[0] + "?limit=5&offset=0").status_code == 200
    name = path.split("?")[1].split("=")[0]
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith(f"query parameter {name!r}: expected an integer "), r.text


def test_every_answer_carries_nosniff_and_no_store(srv):
    """JSON of /api/v1 and /console/api, protobuf results, and the guard's own refusals (before:
    only the console's page had them)."""
    with raw_client(srv) as http, raw_client(srv, api_key=None) as anonymous:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        answers = [http.get("/api/v1/sessions"), http.get(f"/api/v1/sessions/{sid}"), wait_result(http, fut["request_id"]),
                   http.get("/console/api/me"), http.get("/console/api/runs"), http.get("/api/v1/training_runs/nope"),
                   http.get("/console/api/runs?limit=0"), http.get("/api/v1/healthz"), anonymous.get("/api/v1/sessions"),
                   http.post("/api/v1/create_session", content=b"x" * (5 * 2**20)), http.get("/")]
        http.post(f"/api/v1/sessions/{sid}/finish", json={})
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 200, 404, 400, 200, 401, 413, 200]
    for a in answers:
        assert a.headers["x-content-type-options"] == "nosniff", a.request.url
        assert a.headers["cache-control"] == "no-store", a.request.url


def test_healthz_is_answered_at_the_headers_whatever_the_app_is_doing(srv):
    """With every route stuck (the app behind the guard never answers), /healthz still does, and
    takes no body: a POST with a declared body is answered without reading it."""
    stuck = threading.Event()
    app, release = srv.app.app, asyncio.Event()

    async def never(scope, receive, send):
        stuck.set()
        await release.wait()

    srv.app.app = never
    try:
        with raw_client(srv, api_key=None) as http:
            assert http.get("/api/v1/healthz").json() == {"status": "ok"}
            assert http.head("/api/v1/healthz").status_code == 200
        answer = _raw(srv, b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n{")
        assert answer.startswith(b"HTTP/1.1 405")
    finally:
        srv.app.app = app
    assert not stuck.is_set()  # the app was never asked


def test_a_keyless_server_answers_the_names_it_is_told_to(tmp_path):
    with ServerThread(tmp_path / "state", api_key=None, allowed_hosts=("box.lan",)) as srv, \
            raw_client(srv, api_key=None) as http:
        assert http.get("/api/v1/sessions", headers={"Host": "box.lan:8000"}).status_code == 200
        assert http.get("/api/v1/sessions", headers={"Host": "[::1]:8000"}).status_code == 200
        assert http.get("/api/v1/sessions", headers={"Host": "other.lan"}).status_code == 403
        assert http.get("/api/v1/healthz", headers={"Host": "other.lan"}).status_code == 200  # health checks: any
    with ServerThread(tmp_path / "any", api_key=None, allowed_hosts=("*",)) as srv, raw_client(srv, api_key=None) as http:
        assert http.get("/api/v1/sessions", headers={"Host": "other.lan"}).status_code == 200
        assert http.post("/api/v1/create_session", content=b"{}", headers={"Content-Type": "text/plain"}
                         ).status_code == 415  # still no cross-site simple requests


def test_the_tinker_client_trains_against_a_keyless_server(tmp_path):
    """The checks of a keyless server let the real client through (it sends JSON, no Origin)."""
    with ServerThread(tmp_path / "state", api_key=None) as srv:
        service = srv.service_client(api_key="tml-anything")
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        from _server_harness import next_token_datum

        assert tc.forward_backward([next_token_datum(5)], "cross_entropy").result(timeout=HANG_S).metrics
        service.close("success").result()


def test_curves_are_read_on_one_thread_once_per_step_count(srv, monkeypatch):
    """Ten consoles polling one run: one computation at a time, none repeated for a step count
    already answered (before: ten at once on the default pool, each answer encoded on the loop)."""
    from skyrl_sdk.server.state.history import History

    history = srv.runtime.history
    service = srv.service_client()
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    from _server_harness import next_token_datum

    tc.forward_backward([next_token_datum(5)], "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
    running, most, computed = [0], [0], [0]
    lock = threading.Lock()
    real = History.curves

    def counting(self, run_id, points=1000):
        with lock:
            running[0] += 1
            computed[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # a slow read, so that overlapping ones would overlap
        try:
            return real(self, run_id, points)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(History, "curves", counting)
    answers = []

    def poll():
        with raw_client(srv) as http:
            answers.append(http.get(f"/console/api/runs/{tc.model_id}/curves?points=100").json())

    threads = [threading.Thread(target=poll) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert len(answers) == 10 and all(a == answers[0] for a in answers) and answers[0]["steps"] == 1
    assert most[0] == 1 and computed[0] == 1  # the others waited for the first
    with raw_client(srv) as http:  # polled again at the same step count: no computation
        before = computed[0]
        assert http.get(f"/console/api/runs/{tc.model_id}/curves?points=100").json() == answers[0]
        assert computed[0] == before
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
        assert http.get(f"/console/api/runs/{tc.model_id}/curves?points=100").json()["steps"] == 2
    service.close("success").result()
    assert history is srv.runtime.history
