"""The connection edge on loopback: stalled connections are closed after the header timeout,
the connection cap drops the oldest idle connection (never one with a request in progress),
a body that does not arrive gets 408, the in-flight body budget answers 503, zstd is accepted
only where the server asked for it and is capped while it inflates, and the accept-error log
is rate-limited. Loops are bounded; waits only catch hangs."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
zstandard = pytest.importorskip("zstandard")
from tinker.proto import tinker_public_pb2 as pb

from _server_harness import API_KEY, ServerThread, next_token_datum, raw_client, wait_result
from skyrl_sdk.server.http.edge import install_accept_log_limiter
from skyrl_sdk.server.wire.bodies import Bodies, unzstd_capped

HANG = 60
PROTO = {"Content-Type": "application/x-protobuf"}


def _connect(srv, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=HANG)
    if data:
        s.sendall(data)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (without waiting)."""
    s.setblocking(False)
    try:
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True
    finally:
        s.setblocking(True)


def _wait_closed(socks: list[socket.socket], n: int) -> int:
    deadline = time.monotonic() + HANG
    while (closed := sum(_closed_by_server(s) for s in socks)) < n:
        assert time.monotonic() < deadline, f"{closed} of {len(socks)} closed"
        time.sleep(0.05)
    return closed


def _head(path: str, length: int) -> bytes:
    """A request line and headers with the key, announcing a JSON body of ``length`` bytes."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _healthz(srv) -> int:
    with raw_client(srv, api_key=None) as http:
        return http.get("/api/v1/healthz").status_code


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), header_timeout_s=1.0, max_connections=12, body_timeout_s=2.0,
                      send_timeout_s=1.0,
                      max_body_bytes=2**20, max_json_body_bytes=64 * 1024, max_inflight_body_bytes=256 * 1024,
                      client_config={"proto_compress_fwdbwd": True}) as server:
        yield server


def test_half_sent_request_lines_are_closed_after_the_header_timeout(srv):
    socks = [_connect(srv, b"GET /api/v1/hea") for _ in range(10)]  # no key, no end of line
    try:
        assert _wait_closed(socks, len(socks)) == len(socks)
        assert _healthz(srv) == 200
    finally:
        for s in socks:
            s.close()


def test_the_next_request_after_an_answer_gets_the_same_timeout(srv):
    s = _connect(srv, b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert s.recv(1 << 16).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /api/v1/he")  # keep-alive, then a stall (any byte cancels uvicorn's own timer)
        assert _wait_closed([s], 1) == 1
    finally:
        s.close()


def test_the_connection_cap_drops_the_oldest_idle_connection(srv):
    socks = [_connect(srv) for _ in range(20)]  # silent; each beyond the cap pushes out the oldest
    try:
        _wait_closed(socks[:8], 8)
        assert _healthz(srv) == 200  # room is made for it
        assert len(srv.server.server_state.connections) <= 12
    finally:
        for s in socks:
            s.close()


def _in_request(srv) -> int:
    return sum(c._in_request() for c in list(srv.server.server_state.connections))


def _wait_in_request(srv, n: int) -> None:
    deadline = time.monotonic() + HANG
    while _in_request(srv) < n:  # (the heads are parsed)
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_stalled_body_makes_room_for_a_new_client_and_the_others_get_408(srv):
    """The cap full of requests whose bodies stalled: a newcomer is served; the connection whose
    body went longest without a byte makes room (closed unanswered); the rest get 408."""
    busy = []
    for _ in range(12):  # the whole cap, each with a request in progress, oldest first
        busy.append(_connect(srv, _head("/api/v1/create_session", 100) + b"{"))
        _wait_in_request(srv, len(busy))
    try:
        assert _healthz(srv) == 200  # before: reset, until the bodies' deadline
        answers = []
        for s in busy:
            s.settimeout(HANG)
            answers.append(s.recv(1 << 16))
        assert answers[0] == b""  # the first stalled: dropped for the newcomer
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers[1:])  # the body never came
    finally:
        for s in busy:
            s.close()


def _answered_by(s: socket.socket) -> bytes:
    """What the server sent on ``s`` until it closed it (b"" if it dropped it unanswered)."""
    s.settimeout(HANG)
    out = b""
    try:
        while piece := s.recv(1 << 16):
            out += piece
    except OSError:  # reset
        pass
    return out


def test_long_polls_count_against_their_owners_share_not_the_whole_cap(tmp_path):
    """Issue 41, item 7. Before: the cap full of one owner's long-polls (whole requests, waiting
    for a result) turned every newcomer away, /healthz and other owners included. Now a
    newcomer is served: the oldest long-poll of the owner holding more than its share is
    answered at once (429, Retry-After: 1, then closed; its client polls again), and no
    long-poll is dropped unanswered."""
    keys = {"tml-alice-0123456789": "alice", "tml-bob-0123456789ab": "bob"}
    with ServerThread(tmp_path / "state", api_key=None, api_keys=keys, max_connections=8) as server:
        service = server.service_client(api_key="tml-alice-0123456789")
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        with raw_client(server, api_key="tml-alice-0123456789") as http:  # seq_id 50 waits for 1..49
            msg = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=50, loss_fn="cross_entropy")
            waiting = http.post("/api/v1/forward_backward", content=msg.SerializeToString(), headers=PROTO).json()
        body = json.dumps({"request_id": waiting["request_id"]}).encode()
        head = _head("/api/v1/retrieve_future", len(body)).replace(API_KEY.encode(), b"tml-alice-0123456789")
        polls = []
        for _ in range(8):  # the whole cap
            polls.append(_connect(server, head + body))
            _wait_in_request(server, len(polls))
        try:
            assert _healthz(server) == 200
            with raw_client(server, api_key="tml-bob-0123456789ab") as bob:
                assert bob.get("/api/v1/sessions").status_code == 200
            ended = [s for s in polls if _readable(s)]
            assert ended, "no long-poll made room"
            for s in ended:
                answer = _answered_by(s)
                assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in answer.lower(), answer[:300]
        finally:
            for s in polls:
                s.close()
            service.close("success").result()


def _readable(s: socket.socket) -> bool:
    """Whether the server sent something on ``s`` or closed it (without waiting or reading)."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True
    finally:
        s.setblocking(True)


def _served_healthz_within_hang(srv) -> None:
    """A new connection's /healthz is answered (retried while the server has no room yet)."""
    import httpx

    deadline = time.monotonic() + HANG
    while True:
        try:
            if _healthz(srv) == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "no connection was ever made room for"
        time.sleep(0.1)


def test_connections_that_never_read_their_answers_make_room_and_are_dropped(srv):
    """Issue 41, item 1. Before: connections that each sent 400 pipelined requests in one write
    (a 4 KiB receive buffer) and never read locked every new client out, key or no key, for as
    long as they stayed open: a connection whose request had arrived was never dropped and
    nothing bounded the write. Now one whose answer goes unread makes room for a newcomer, and
    is dropped after ``send_timeout_s`` anyway."""
    pipelined = b"GET /console/console.js HTTP/1.1\r\nHost: x\r\n\r\n" * 400
    socks = []
    try:
        for _ in range(12):  # the whole cap
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(HANG)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(pipelined)
            socks.append(s)
        _served_healthz_within_hang(srv)
        assert _wait_closed(socks, len(socks)) == len(socks)  # the send timeout (1 s here) dropped the rest
    finally:
        for s in socks:
            s.close()


def test_a_client_that_does_not_take_its_answers_gets_no_more_computed(srv):
    """Issue 41, item 1: h11's backpressure. Before: uvicorn computed the answer to every
    pipelined request as long as its own buffer was under 64 KiB, and the kernel takes
    megabytes for a client that never reads (1010 such connections kept the server busy for a
    minute and a half, every newcomer timing out). Now the next request waits until the client
    has taken (acknowledged) the previous answer: one answer, then nothing until it reads."""
    state = srv.server.server_state
    before = state.total_requests
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(HANG)
    try:
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"GET /console/console.js HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
        deadline = time.monotonic() + HANG
        while not any(getattr(c, "_held", False) for c in list(state.connections)):
            assert time.monotonic() < deadline, "the connection was never held"
            time.sleep(0.01)
        assert state.total_requests - before <= 2
    finally:
        s.close()


def test_a_connection_may_pipeline_only_so_many_requests(srv):
    """Issue 41, item 1: after ``max_pipelined_requests`` (32) requests sent before their answers
    were read, the connection is closed after the next answer (before: 400 were all answered)."""
    s = _connect(srv, b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
    try:
        answers = _answered_by(s).count(b"HTTP/1.1 200")
    finally:
        s.close()
    assert answers == 33  # the first, then 32 that had arrived before it was answered


def test_the_in_flight_body_budget_answers_503(srv):
    holders = [_connect(srv, _head("/api/v1/telemetry", 60_000) + b" " * 50_000) for _ in range(5)]  # 250 KB of the 256 KiB budget
    try:
        deadline = time.monotonic() + HANG
        while srv.app.bodies.inflight_bytes < 250_000:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with raw_client(srv) as http:
            r = http.post("/api/v1/telemetry", content=b" " * 20_000, headers={"Content-Type": "application/json"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        for s in holders:
            s.close()
    deadline = time.monotonic() + HANG
    while srv.app.bodies.inflight_bytes:  # released when the requests end (here: with their 408)
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---- zstd -------------------------------------------------------------------------------------------
def _zstd(data: bytes, declare_size: bool) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=declare_size).compress(data)


def test_unzstd_capped_stops_at_the_cap_whatever_the_header_says():
    big = b"[" + b"0," * 3_000_000 + b"0]"
    for declared in (True, False):
        frame = _zstd(big, declared)
        assert len(frame) < 10_000
        assert unzstd_capped(frame, 2**20) is None
        assert unzstd_capped(frame, len(big)) == big
    with pytest.raises(zstandard.ZstdError):
        unzstd_capped(b"not zstd at all", 2**20)


def test_zstd_bombs_get_413_and_healthz_keeps_answering(srv):
    bomb = _zstd(b"\0" * 50_000_000, declare_size=False)  # 50 MB from a few KB, size not declared
    statuses: list[int] = []

    def send():
        with raw_client(srv) as http:
            statuses.append(http.post("/api/v1/forward_backward", content=bomb,
                                      headers={**PROTO, "Content-Encoding": "zstd"}).status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    health = [_healthz(srv) for _ in range(5)]
    for t in threads:
        t.join(HANG)
    assert statuses == [413] * 4 and health == [200] * 5


def test_zstd_only_on_forward_backward_and_only_when_asked(srv, tmp_path):
    with raw_client(srv) as http:
        r = http.post("/api/v1/create_session", content=_zstd(b"{}", True),
                      headers={"Content-Type": "application/json", "Content-Encoding": "zstd"})
        assert r.status_code == 415 and "forward_backward" in r.json()["detail"]
        r = http.post("/api/v1/forward_backward", content=b"garbage", headers={**PROTO, "Content-Encoding": "zstd"})
        assert r.status_code == 400 and "zstd" in r.json()["detail"]
    with ServerThread(tmp_path / "state") as plain, raw_client(plain) as http:  # never asked for compression
        r = http.post("/api/v1/forward_backward", content=_zstd(b"x", True), headers={**PROTO, "Content-Encoding": "zstd"})
        assert r.status_code == 415


def test_the_tinker_client_compresses_when_asked_and_it_works(srv):
    service = srv.service_client()
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    out = tc.forward_backward([next_token_datum(39)] * 20, "cross_entropy").result(timeout=HANG)
    assert np.isfinite(out.metrics["loss:sum"])
    service.close("success").result()


def test_json_bodies_have_their_own_cap(srv):
    with raw_client(srv) as http:
        r = http.post("/api/v1/create_session", content=b'{"tags": ["' + b"x" * 70_000 + b'"]}',
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and str(64 * 1024) in r.json()["detail"]
        big_proto = pb.ForwardBackwardRequest(model_id="nope", loss_fn="x" * 100_000).SerializeToString()
        fut = http.post("/api/v1/forward_backward", content=big_proto, headers=PROTO).json()  # protobuf: 1 MiB cap
        assert "unknown model_id" in wait_result(http, fut["request_id"]).json()["error"]


# ---- the accept-error log ----------------------------------------------------------------------------
def test_accept_failures_are_logged_once_per_interval(caplog):
    loop = asyncio.new_event_loop()
    passed: list[dict] = []
    loop.set_exception_handler(lambda lp, ctx: passed.append(ctx))
    install_accept_log_limiter(loop, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk.server.http.edge"):
        for _ in range(500):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
    loop.close()
    lines = [r for r in caplog.records if "accept() failed" in r.getMessage()]
    assert len(lines) == 1 and passed == [{"message": "something else"}]


def test_the_body_budget_admits_one_body_larger_than_itself():
    bodies = Bodies(100)
    assert bodies.reserve(150)  # alone: admitted
    assert not bodies.reserve(1)
    bodies.release(150)
    assert bodies.reserve(60) and bodies.reserve(40) and not bodies.reserve(1)
