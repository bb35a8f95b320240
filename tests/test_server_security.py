"""Owners: every route x {no key, wrong key, another owner's key}.

Alice owns a session, a model, a saved checkpoint, a sampler checkpoint, a sampling session
and a finished future. Without a key or with an unknown key every route answers 401; with
Bob's key each of Alice's ids reads exactly like an id that does not exist (404 on direct
routes, a future failed with "unknown ..." on future routes), Bob's listings hold none of
Alice's things, and nothing of Alice's changes. Each route x key is a probe, counted by group (tried /
handled) into ``$SKYRL_PROBE_REPORT`` (see tests/_probes.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from _probes import Probes
from _server_harness import ServerThread, raw_client, wait_result
from skyrl_sdk.errors import InputError
from skyrl_sdk.server.config import ServerConfig, read_api_keys
from skyrl_sdk.server.http.guard import OPEN_PATHS, OPEN_PREFIXES
from skyrl_sdk.server.wire.compat import NOT_SERVED_PREFIX, ROWS

ALICE, BOB = "tml-alice", "tml-bob"
#: the client routes this server declines (one 404 each, behind the key like every route)
DECLINED = sorted((m, p) for (m, p), (served, _, _) in ROWS.items() if not served)
#: entries of the route table: every route of the app but the open ones (/healthz, the console's
#: page and static files: guard.OPEN_PATHS; signed download links: guard.OPEN_PREFIXES),
#: load_weights and asample each in both their forms
ROUTES = 41 + len(DECLINED)
#: route x key probes tried / handled, by group; $SKYRL_PROBE_REPORT
PROBES = Probes("server security: route x key")
_probe_report = PROBES.report_fixture()


def _fwdbwd(model_id: str, seq_id: int) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3], np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.array([2, 3, 4]).tobytes(),
                                                          dtype=pb.DTYPE_INT64, shape=[3]))
    return msg.SerializeToString()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# key owner\n{ALICE} alice\n{BOB} bob\n\n")
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys=read_api_keys(keys)) as srv:
        service = srv.service_client(api_key=ALICE)
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        saved = tc.save_state("ckpt").result().path
        tc.save_weights_external("exp").result()
        sampler_path = tc.save_weights_for_sampler("smp").result().path
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        with raw_client(srv, ALICE) as http:
            sid = http.get("/api/v1/sessions").json()["sessions"][0]
            fut = http.post("/api/v1/optim_step", json={"model_id": tc.model_id, "adam_params": {}}).json()
            assert "metrics" in wait_result(http, fut["request_id"]).json()
            sampling_id = http.post("/api/v1/create_sampling_session", json={
                "session_id": sid, "sampling_session_seq_id": 77, "base_model": "tiny"}).json()["sampling_session_id"]
        yield dict(srv=srv, service=service, tc=tc, sid=sid, run=tc.model_id, saved=saved, sampler=sampler,
                   sampler_path=sampler_path, sampling_id=sampling_id, request_id=fut["request_id"])
        service.close("success").result()


def _routes(w: dict) -> list[tuple[str, str, dict]]:
    """(method, path, json body) of every route, aimed at Alice's things."""
    run, sid = w["run"], w["sid"]
    return [
        ("POST", "/api/v1/client/config", {}),
        ("POST", "/api/v1/client/dynamic_config", {}),
        ("GET", "/api/v1/get_server_capabilities", {}),
        ("GET", "/api/v1/loaded", {}),
        ("POST", "/api/v1/create_session", {}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": sid}),
        ("GET", f"/api/v1/sessions/{sid}", {}),
        ("GET", "/api/v1/sessions", {}),
        ("POST", f"/api/v1/sessions/{sid}/finish", {}),
        ("POST", "/api/v1/create_model", {"session_id": sid, "model_seq_id": 9, "base_model": "tiny"}),
        ("POST", "/api/v1/get_info", {"model_id": run}),
        ("POST", "/api/v1/forward_backward", {}),
        ("POST", "/api/v1/optim_step", {"model_id": run, "seq_id": 1000, "adam_params": {}}),
        ("POST", "/api/v1/save_weights", {"model_id": run, "path": "stolen"}),
        ("POST", "/api/v1/save_weights_for_sampler", {"model_id": run, "path": "stolen"}),
        ("POST", "/api/v1/load_weights", {"model_id": run, "path": w["saved"]}),
        ("POST", "/api/v1/load_weights", {"session_id": sid, "model_seq_id": 5, "path": w["saved"]}),
        ("POST", "/api/v1/create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 3,
                                                     "base_model": "tiny"}),
        ("GET", f"/api/v1/samplers/{w['sampling_id']}", {}),
        ("POST", "/api/v1/asample", {"sampling_session_id": w["sampling_id"], "seq_id": 1,
                                     "prompt": {"chunks": [{"tokens": [1, 2]}]}, "num_samples": 1}),
        ("POST", "/api/v1/asample", {"model_path": w["sampler_path"], "prompt": {"chunks": [{"tokens": [1, 2]}]}}),
        ("POST", "/api/v1/retrieve_future", {"request_id": w["request_id"]}),
        ("POST", "/api/v1/cancel_future", {"request_id": w["request_id"]}),
        ("GET", "/api/v1/training_runs", {}),
        ("GET", f"/api/v1/training_runs/{run}", {}),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints", {}),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/weights/ckpt", {}),
        ("GET", "/api/v1/checkpoints", {}),
        ("POST", "/api/v1/weights_info", {"tinker_path": w["saved"]}),
        ("POST", "/api/v1/telemetry", {"events": []}),
        ("POST", "/api/v1/save_weights_external", {"model_id": run, "path": "stolen"}),
        ("POST", f"/api/v1/training_runs/{run}/checkpoints/weights/ckpt/publish", {}),
        ("DELETE", f"/api/v1/training_runs/{run}/checkpoints/weights/ckpt/publish", {}),
        ("PUT", f"/api/v1/training_runs/{run}/checkpoints/weights/ckpt/ttl", {"ttl_seconds": 3600}),
        ("GET", f"/api/v1/training_runs/{run}/checkpoints/external_weights/exp/external_weights_urls", {}),
        ("POST", "/api/v1/sessions/search", {}),
        *[(m, p.replace("{session_id}", sid), {}) for m, p in DECLINED],
        ("GET", "/console/api/me", {}),
        ("GET", "/console/api/runs", {}),
        ("GET", f"/console/api/runs/{run}", {}),
        ("GET", f"/console/api/runs/{run}/curves", {}),
        ("GET", "/console/api/server", {}),
    ]


def _send(http, method: str, path: str, body: dict):
    if path.endswith("/forward_backward"):
        return http.post(path, content=_fwdbwd(body.get("model_id", ""), 1000),
                         headers={"Content-Type": "application/x-protobuf"})
    if method == "GET":
        return http.get(path)
    if method == "DELETE":
        return http.delete(path)
    if method == "PUT":
        return http.put(path, json=body)
    return http.post(path, json=body)


def test_the_route_table_covers_every_route_of_the_app(world):
    import re

    paths = world["srv"].app.fastapi.openapi()["paths"]
    served = {(m.upper(), p) for p, ops in paths.items() for m in ops if not p.startswith(OPEN_PREFIXES)}
    served -= {("GET", p) for p in OPEN_PATHS}
    table = [(m, p) for m, p, _ in _routes(world)]

    def covered(method: str, template: str) -> bool:
        pattern = "".join(".+" if part.startswith("{") else re.escape(part) for part in re.split(r"({[^}]+})", template))
        return any(m == method and re.fullmatch(pattern, p) for m, p in table)

    assert len(served) > 20 and sorted(r for r in served if not covered(*r)) == []


@pytest.mark.parametrize("key", [None, "tml-wrong", ALICE + "x"])
def test_every_route_needs_a_known_key(world, key):
    group = "no key" if key is None else "unknown key"
    tried, handled = PROBES.of(group)
    routes = _routes(world)
    assert len(routes) == ROUTES
    with raw_client(world["srv"], key) as http:
        for method, path, body in routes:
            PROBES.tried(group)
            r = _send(http, method, path, body)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            PROBES.handled(group, "401")
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}
    assert PROBES.of(group) == (tried + len(routes), handled + len(routes))


def test_the_open_paths_answer_the_same_to_anyone_and_hold_no_data(world):
    """The routes without a key (health, the console's page and files) say nothing of anyone."""
    answers = []
    for key in (None, "tml-wrong", ALICE):
        with raw_client(world["srv"], key) as http:
            answers.append({p: http.get(p) for p in sorted(OPEN_PATHS)})
    for path in OPEN_PATHS:
        first = answers[0][path]
        assert first.status_code == 200 and all(a[path].content == first.content for a in answers), path
        assert world["run"] not in first.text and world["sid"] not in first.text and "alice" not in first.text


def test_another_owner_sees_nothing_and_changes_nothing(world):
    w = world
    group = "another owner's key"
    routes = [(m, p, {"model_id": w["run"]} if p.endswith("/forward_backward") else b) for m, p, b in _routes(w)]
    with raw_client(w["srv"], BOB) as bob:
        for method, path, body in routes:
            PROBES.tried(group)
            r = _send(bob, method, path, body)
            if path.endswith(("/client/config", "/dynamic_config", "/get_server_capabilities", "/telemetry",
                              "/cancel_future", "/create_session", "/loaded", "/console/api/me")):
                assert r.status_code == 200
                assert w["run"] not in r.text and w["sid"] not in r.text, (path, r.text)
                PROBES.handled(group, "200, nothing of another owner")
                continue
            if (path.endswith(("/sessions", "/training_runs", "/checkpoints", "/console/api/runs")) and method == "GET"
                    and "/training_runs/" not in path) or path.endswith("/sessions/search"):
                assert r.status_code == 200, (path, r.text)
                assert w["run"] not in r.text and w["sid"] not in r.text, (path, r.text)
                PROBES.handled(group, "200, nothing of another owner")
                continue
            if r.status_code == 200 and "request_id" in r.json() and "error" not in r.json():
                answer = wait_result(bob, r.json()["request_id"]).json()  # a future route: failed, "unknown"
                assert "unknown" in answer["error"] or "no checkpoint" in answer["error"], (path, answer)
                PROBES.handled(group, "failed future, unknown")
                continue
            if path == "/console/api/server":  # Bob is no operator
                assert r.status_code == 403 and w["run"] not in r.text, r.text
                PROBES.handled(group, "403, operators only")
                continue
            if path.endswith("/retrieve_future"):
                assert "unknown request_id" in r.json()["error"]
                PROBES.handled(group, "failed future, unknown")
                continue
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            assert r.json()["detail"].startswith(("unknown", "no checkpoint", NOT_SERVED_PREFIX)), r.text
            PROBES.handled(group, "404")
    assert PROBES.of(group) == (ROUTES, ROUTES)
    # Alice's things are all still there and usable
    with raw_client(w["srv"], ALICE) as alice:
        assert alice.get(f"/api/v1/sessions/{w['sid']}").json()["finished_at"] is None
        ids = {c["checkpoint_id"] for c in alice.get(f"/api/v1/training_runs/{w['run']}/checkpoints").json()[
            "checkpoints"]}
        assert ids == {"weights/ckpt", "sampler_weights/smp", "external_weights/exp"}
        assert "metrics" in wait_result(alice, w["request_id"]).json()
    assert w["sampler"].sample(tt.ModelInput.from_ints([1, 2]), 1, tt.SamplingParams(max_tokens=2)).result()
    assert w["tc"].forward_backward([tt.Datum(model_input=tt.ModelInput.from_ints([1, 2]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array([2, 3]))})], "cross_entropy").result().metrics


def test_no_request_can_take_another_owners_seq_id(world):
    """Bob replays Alice's next (model, seq_id) first; Alice's own request still runs and
    gets its own result."""
    w = world
    with raw_client(w["srv"], ALICE) as alice, raw_client(w["srv"], BOB) as bob:
        model_id = alice.post("/api/v1/create_model", json={"session_id": w["sid"], "model_seq_id": 50,
                                                            "base_model": "tiny", "lora_config": {"rank": 2}}).json()
        assert wait_result(alice, model_id["request_id"]).json()["model_id"] == model_id["model_id"]
        poison = bob.post("/api/v1/forward_backward", content=_fwdbwd(model_id["model_id"], 1),
                          headers={"Content-Type": "application/x-protobuf"}).json()
        assert "unknown model_id" in wait_result(bob, poison["request_id"]).json()["error"]
        mine = alice.post("/api/v1/forward_backward", content=_fwdbwd(model_id["model_id"], 1),
                          headers={"Content-Type": "application/x-protobuf"}).json()
        assert mine["request_id"] != poison["request_id"]
        out = wait_result(alice, mine["request_id"])
        assert out.headers["content-type"] == "application/x-protobuf"
        assert pb.ForwardBackwardOutput.FromString(out.content).metrics["loss:sum"] > 0
        # and Bob cannot read Alice's result by its request id
        assert "unknown request_id" in wait_result(bob, mine["request_id"]).json()["error"]


def test_api_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("tml-a alice  # a comment\ntml-b\n\ntml-c alice\n")
    keys = read_api_keys(f)
    assert keys["tml-a"] == keys["tml-c"] == "alice" and keys["tml-b"].startswith("key-")
    for bad in ("tml-a alice extra\n", "tml-a\ntml-a\n", "# nothing\n"):
        f.write_text(bad)
        with pytest.raises(InputError, match="api-keys"):
            read_api_keys(f)
    with pytest.raises(InputError, match="cannot read"):
        read_api_keys(tmp_path / "missing")


def test_api_keys_file_keeps_hashes_inside_keys_and_reserves_default(tmp_path):
    f = tmp_path / "keys"
    f.write_text("tml-x#secret-0123456789 alice\n# tml-commented out\ntml-y-0123456789abcdef bob # trailing\n")
    keys = read_api_keys(f)
    assert keys == {"tml-x#secret-0123456789": "alice", "tml-y-0123456789abcdef": "bob"}  # no `tml-x` key
    f.write_text("tml-z-0123456789abcdef default\n")
    with pytest.raises(InputError, match="'default' is reserved"):
        read_api_keys(f)
    with pytest.raises(InputError, match="reserved"):
        ServerConfig(api_key="tml-one", api_keys={"tml-two": "default"})
    f.write_text("tml-\u00e9t\u00e9-0123456789 alice\n")
    with pytest.raises(InputError, match="printable ASCII"):
        read_api_keys(f)


def test_api_keys_file_refuses_what_is_not_a_small_utf8_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a FIFO nobody writes: opening it for reading would block forever
    for path, says in ((fifo, "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                       (tmp_path, "not a regular file")):
        with pytest.raises(InputError, match=says):
            read_api_keys(path)
    big = tmp_path / "big"
    big.write_bytes(b"tml-a alice\n" * 200_000)
    with pytest.raises(InputError, match="larger than"):
        read_api_keys(big)
    latin = tmp_path / "latin"
    latin.write_bytes(b"tml-caf\xe9-0123456789 alice\n")
    with pytest.raises(InputError, match="not UTF-8 text"):
        read_api_keys(latin)


def test_api_keys_file_warns_about_short_keys_and_readable_files(tmp_path, caplog):
    f = tmp_path / "keys"
    f.write_text("tml-a alice\ntml-long-enough-0123456789 bob\n")
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk.server.config"):
        read_api_keys(f)
    text = caplog.text
    assert "line(s) 1 are shorter than 16" in text and "can be read by other users" in text
    caplog.clear()
    f.write_text("tml-long-enough-0123456789 bob\n")
    f.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk.server.config"):
        read_api_keys(f)
    assert caplog.text == ""


def test_serve_with_a_bad_api_keys_file_cannot_start(tmp_path, capsys):
    from skyrl_sdk import cli

    f = tmp_path / "keys"
    f.write_bytes(b"\xff\xfe not utf-8\n")
    assert cli.main(["serve", "--port", "1", "--state-dir", str(tmp_path / "s"), "--api-keys", str(f)]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "not UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("api_key, from_env, keys_file, shows", [
    (None, False, None, "TINKER_API_KEY=tml-local"),
    ("tml-secret", True, None, "TINKER_API_KEY=$SKYRL_SDK_API_KEY"),
    ("tml-secret", False, None, "TINKER_API_KEY=<the key given to --api-key>"),
    (None, False, "keys.txt", "TINKER_API_KEY=<a key from keys.txt>"),
    ("tml-secret", False, "keys.txt", "TINKER_API_KEY=<a key from keys.txt or the --api-key>"),
])
def test_the_banner_names_the_key_the_server_accepts(api_key, from_env, keys_file, shows):
    from skyrl_sdk.cli.serve import banner

    text = banner(ServerConfig(api_key=api_key, api_keys={"tml-k-0123456789abcdef": "k"} if keys_file else {}),
                  from_env, keys_file)
    assert shows in text and "tml-secret" not in text
    assert ("checks no key" in text) == (api_key is None and keys_file is None)
