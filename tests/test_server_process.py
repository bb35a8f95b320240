"""``skyrl-sdk serve`` as users run it (its own process, real uvicorn, real sockets), tried the way
a stranger would: bodies trickled in to hold connections, a second server on the same state dir,
a fatal signal; and a server without keys, which web pages can reach. Waits only catch hangs."""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import API_KEY, ServeProcess, next_token_datum

pytestmark = pytest.mark.slow  # each fixture starts a server process
CAP = 16


def _trickle(port: int, path: str, key: str | None) -> socket.socket:
    """A POST's request line and headers announcing a 1 MB body, and one byte of it."""
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            + (f"X-API-Key: {key}\r\n" if key else "") + "Content-Length: 1000000\r\n\r\n{")
    s.sendall(head.encode())
    return s


def _one_try(srv: ServeProcess, method: str, path: str, key: str | None = API_KEY, **kw) -> httpx.Response:
    """One request on a new connection, no retry (a reset connection fails the test at once)."""
    headers = {"X-API-Key": key} if key else {}
    with httpx.Client(base_url=srv.url, headers=headers, timeout=HANG_S, transport=httpx.HTTPTransport(retries=0)) as c:
        return c.request(method, path, **kw)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    state = tmp_path_factory.mktemp("keyed")
    with ServeProcess(state, "--api-key", API_KEY, "--max-connections", str(CAP), "--max-lora-adapters", "1") as srv:
        srv.state = state
        yield srv


def test_trickled_bodies_lock_no_one_out(keyed):
    """16 connections (the whole cap) each send a POST's headers with Content-Length 1000000 and
    one byte: first to the open /healthz (answered at the headers, the body never read), then
    with the key to create_session (a body in progress: the longest stalled makes room). Each
    time a new keyed client and /healthz are served (before: reset until the 120 s deadline)."""
    for path, key in (("/api/v1/healthz", None), ("/api/v1/create_session", API_KEY)):
        held = [_trickle(keyed.port, path, key) for _ in range(CAP)]
        try:
            assert _one_try(keyed, "POST", "/api/v1/create_session", json={}).status_code == 200, path
            assert _one_try(keyed, "GET", "/api/v1/healthz", key=None).json() == {"status": "ok"}, path
        finally:
            for s in held:
                s.close()


def test_a_second_server_on_the_same_state_dir_is_refused_and_the_first_loses_nothing(keyed):
    """The first server has offloaded one client's adapter to its state dir; a second ``serve``
    on that dir exits with one line naming the dir and the holder, and deletes nothing: the
    offloaded client trains on (before: the second started, its clean-up deleted the offload
    files, and the first server's next call for that client failed)."""
    service = tinker.ServiceClient(base_url=keyed.url, api_key=API_KEY)
    clients = [service.create_lora_training_client(base_model="tiny", rank=2, seed=s).result() for s in (1, 2)]
    for c in clients:  # with --max-lora-adapters 1, the second offloads the first
        c.forward_backward([next_token_datum(6)], "cross_entropy").result()
    offload = keyed.state / "scratch" / "offload"
    files = sorted(p for p in offload.rglob("*") if p.is_file())
    assert files
    second = ServeProcess(keyed.state, "--api-key", API_KEY, wait=False)
    try:
        assert second.wait_exit() == 2
        *progress, last = second.output().strip().splitlines()  # what it was doing, then the one refusal
        assert progress and all(p.startswith("skyrl-sdk serve: ") and "cannot" not in p for p in progress)
        resolved = keyed.state.resolve()
        since = last.split(" since ", 1)[1][:19]  # the first server's start time
        assert last == (f"skyrl-sdk serve: cannot start: state dir {resolved} is in use by another server (pid "
                        f"{keyed.proc.pid} on {socket.gethostname()} since {since}: skyrl-sdk serve on "
                        f"127.0.0.1:{keyed.port}); stop it first, or give this one another --state-dir")
    finally:
        second.stop()
    assert sorted(p for p in offload.rglob("*") if p.is_file()) == files
    for c in clients:  # the offloaded one is read back from those files
        out = c.forward_backward([next_token_datum(6)], "cross_entropy").result(timeout=HANG_S)
        assert np.isfinite(out.metrics["loss:sum"])
        assert c.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics["skipped"] == 0.0
    service.close("success").result()


def test_a_fatal_signal_leaves_every_threads_stack_in_the_log(keyed):
    """Last in this file: the server is killed by SIGSEGV (as a file mapping that cannot grow
    kills with SIGBUS): before, it died without a line; now faulthandler writes the signal and
    every thread's Python stack."""
    os.kill(keyed.proc.pid, signal.SIGSEGV)
    assert keyed.wait_exit() == -signal.SIGSEGV
    out = keyed.output()
    assert "Fatal Python error: Segmentation fault" in out
    assert "Current thread" in out or "Thread 0x" in out


# ---- a server without keys: web pages can reach it ----------------------------------------------------
@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    with ServeProcess(tmp_path_factory.mktemp("keyless"), "--max-connections", str(CAP),
                      env={"SKYRL_SDK_API_KEY": ""}) as srv:
        yield srv


def test_a_keyless_server_takes_new_clients_past_trickled_bodies(keyless):
    held = [_trickle(keyless.port, "/api/v1/create_session", None) for _ in range(CAP)]
    try:
        assert _one_try(keyless, "POST", "/api/v1/create_session", key=None, json={}).status_code == 200
        assert _one_try(keyless, "GET", "/api/v1/healthz", key=None).status_code == 200
    finally:
        for s in held:
            s.close()


def test_a_keyless_server_refuses_rebound_hosts_cross_site_posts_and_non_json(keyless):
    """DNS rebinding (a page's own name resolving to 127.0.0.1) and cross-site simple requests:
    refused, and nothing is created (before: answered, sessions created from a web page)."""
    ok = {"Content-Type": "application/json"}
    before = _one_try(keyless, "GET", "/api/v1/sessions", key=None).json()["sessions"]
    evil = _one_try(keyless, "GET", "/api/v1/sessions", key=None, headers={"Host": "attacker.example:80"})
    assert evil.status_code == 403 and "--allowed-host" in evil.json()["detail"]
    posted = _one_try(keyless, "POST", "/api/v1/create_session", key=None, content=json.dumps({"user_metadata": {}}),
                      headers={"Content-Type": "text/plain"})
    assert posted.status_code == 415 and "application/json" in posted.json()["detail"]
    cross = _one_try(keyless, "POST", "/api/v1/create_session", key=None, json={},
                     headers={"Origin": "http://attacker.example"})
    assert cross.status_code == 403 and "Origin" in cross.json()["detail"]
    same = _one_try(keyless, "POST", "/api/v1/create_session", key=None, json={},
                    headers={**ok, "Origin": keyless.url})  # the server's own page may
    assert same.status_code == 200
    for host in (f"localhost:{keyless.port}", f"127.0.0.1:{keyless.port}"):
        assert _one_try(keyless, "GET", "/api/v1/sessions", key=None, headers={"Host": host}).status_code == 200
    after = _one_try(keyless, "GET", "/api/v1/sessions", key=None).json()["sessions"]
    assert len(after) == len(before) + 1  # only the same-origin one
