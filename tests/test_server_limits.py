"""Hostile or careless requests: each limit is checked before anything is allocated and
answered with a clear 4xx (direct routes) or a failed future with category "user" (future
routes); non-finite metrics never reach JSON; a rejected request registers nothing; idle
sessions are reaped; error messages show tinker:// paths; late retries are refused."""

from __future__ import annotations

import asyncio
import json
import resource
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from _limits import HANG_S
from _server_harness import API_KEY, ServerThread, next_token_datum, raw_client, wait_result

MAX_SEQ, MAX_SAMPLES, MAX_BODY, MAX_TOKENS = 64, 8, 2**20, 200
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), max_seq_len=MAX_SEQ, max_num_samples=MAX_SAMPLES,
                      max_body_bytes=MAX_BODY, max_tokens_per_request=MAX_TOKENS) as server:
        yield server


@pytest.fixture(scope="module")
def model(srv):
    """(session id, model id) of a raw-HTTP LoRA model."""
    with raw_client(srv) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        assert wait_result(http, fut["request_id"]).json()["model_id"] == fut["model_id"]
        return sid, fut["model_id"]


def _user_error(http, answer: dict) -> str:
    doc = wait_result(http, answer["request_id"]).json()
    assert doc["category"] == "user", doc
    return doc["error"]


def _datum_msg(model_id: str, n_tokens: int, seq_id: int = 0) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(n_tokens, dtype=np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.arange(1, n_tokens + 1).tobytes(),
                                                          dtype=pb.DTYPE_INT64, shape=[n_tokens]))
    return msg


# ---- NaN never reaches JSON ---------------------------------------------------------------------
def test_skipped_optim_step_reaches_the_real_client(srv):
    service = srv.service_client()
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    huge = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array([2, 3, 4, 5])),
        "weights": tt.TensorData.from_numpy(np.full(4, 3e38, np.float32))})
    tc.forward_backward([huge], "cross_entropy").result()
    metrics = tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics
    assert metrics["skipped"] == 1.0 and "grad_norm" not in metrics  # NaN grad_norm: left out
    ok = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array([2, 3, 4]))})
    tc.forward_backward([ok], "cross_entropy").result()
    again = tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics
    assert again["skipped"] == 0.0 and np.isfinite(again["grad_norm"])
    service.close("success").result()


def test_result_json_is_strict():
    from skyrl_sdk.server.compute.futures import Result
    from skyrl_sdk.server.wire.envelopes import optim_step_json

    body = Result.json({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}}).body
    assert json.loads(body) == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    assert optim_step_json({"grad_norm": float("nan"), "skipped": 1.0}) == {"metrics": {"skipped": 1.0}}


# ---- sizes checked before allocation --------------------------------------------------------------
def test_sparse_tensor_declared_shape_checked_before_densifying(srv, model):
    msg = _datum_msg(model[1], 4)
    huge = msg.data[0].loss_fn_inputs["weights"]
    huge.dtype, huge.shape[:] = pb.DTYPE_FLOAT32, [20000, 20000]
    huge.sparse_csr.crow_indices = np.zeros(20001, np.int64).tobytes()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the server runs in this process
    with raw_client(srv) as http:
        error = _user_error(http, http.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                                            headers=PROTO).json())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 400 * 1024  # dense: 1.6 GB
    assert "datum 0" in error and "weights" in error and "[20000, 20000]" in error and "4096" in error


def test_sequence_length_limit(srv, model):
    with raw_client(srv) as http:
        error = _user_error(http, http.post("/api/v1/forward_backward", headers=PROTO,
                                            content=_datum_msg(model[1], MAX_SEQ + 1).SerializeToString()).json())
        assert f"{MAX_SEQ + 1} tokens" in error and f"at most {MAX_SEQ}" in error
        fine = http.post("/api/v1/forward_backward", content=_datum_msg(model[1], MAX_SEQ).SerializeToString(),
                         headers=PROTO).json()
        assert wait_result(http, fine["request_id"]).headers["content-type"] == "application/x-protobuf"


def test_sequence_limit_defaults_to_the_models_positions():
    from skyrl_sdk.server.compute.served import ServedModels
    from skyrl_sdk.server.config import ServerConfig

    assert ServedModels(ServerConfig()).max_seq_len("tiny") == 2048  # tiny's max_position_embeddings
    assert ServedModels(ServerConfig(max_seq_len=100)).max_seq_len("tiny") == 100


def test_sample_request_validated_before_num_samples(srv):
    with raw_client(srv) as http:
        bad_prompt = http.post("/api/v1/asample", json={"base_model": "tiny", "num_samples": 1_000_000,
                                                        "prompt": {"chunks": [{"tokens": "12>"}]}}).json()
        assert bad_prompt["sample_sequence_ids"] == []
        assert "flat list of token ids (integers)" in _user_error(http, bad_prompt)
        nested = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": [[1, 2], [3, 4]]}).json()
        assert "flat list" in _user_error(http, nested)
        too_many = http.post("/api/v1/asample", json={"base_model": "tiny", "num_samples": MAX_SAMPLES + 1,
                                                      "prompt": [1, 2, 3]}).json()
        assert too_many["sample_sequence_ids"] == []
        assert f"1..{MAX_SAMPLES}" in _user_error(http, too_many)
        too_long = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": list(range(60)),
                                                      "sampling_params": {"max_tokens": 10}}).json()
        assert f"the prompt (60 tokens) plus max_tokens (10) has 70 tokens; this model accepts at most {MAX_SEQ}" \
            in _user_error(http, too_long)
        bad_param = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": [1, 2],
                                                       "sampling_params": {"temperature": "hot"}}).json()
        assert "SamplingParams.temperature" in _user_error(http, bad_param)
        for fields, says in (({"base_model": 7}, "base_model: expected a string, got int"),
                             ({"model_path": ["tinker://x"]}, "model_path: expected a string, got list"),
                             ({"sampling_session_id": 5}, "sampling_session_id: expected a string, got int"),
                             ({"base_model": "tiny", "seq_id": "1"}, "seq_id: expected an integer in 0..")):
            answer = http.post("/api/v1/asample", json={"prompt": [1, 2], **fields}).json()
            assert says in _user_error(http, answer), fields
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
        refused = http.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": 3})
        assert refused.status_code == 400 and "base_model: expected a string, got int" in refused.text


def test_unknown_keys_are_refused_over_http(srv, model):
    """A misspelt key is refused over HTTP as in process, in the same words (a ``temprature``
    once sampled at the default temperature); an envelope's unknown key too."""
    from skyrl_sdk.inputs.sample import sample_request_from_any

    with pytest.raises(ValueError) as in_process:
        sample_request_from_any([[1, 2]], {"temprature": 0.5})
    with raw_client(srv) as http:
        answer = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": [1, 2],
                                                    "sampling_params": {"temprature": 0.5}}).json()
        assert _user_error(http, answer) == str(in_process.value)
        assert "did you mean 'temperature'?" in str(in_process.value)
        answer = http.post("/api/v1/optim_step", json={"model_id": model[1], "adam_params": {"learning_rat": 1}})
        assert "AdamParams: unknown keys ['learning_rat']" in _user_error(http, answer.json())
        answer = http.post("/api/v1/asample", json={"base_model": "tiny", "prompt": [1, 2], "num_sample": 2})
        assert "asample: unknown keys ['num_sample']" in _user_error(http, answer.json())
        refused = http.post("/api/v1/create_session", json={"tags": [], "user_metdata": {}})
        assert refused.status_code == 400 and "did you mean 'user_metadata'?" in refused.text


def test_chunked_body_too_large_is_413(srv):
    def chunks():
        for _ in range(MAX_BODY // 2**16 + 2):
            yield b"\0" * 2**16

    with raw_client(srv) as http:
        r = http.post("/api/v1/forward_backward", content=chunks(), headers=PROTO)
        assert r.status_code == 413 and "larger than" in r.json()["detail"]
        assert http.get("/api/v1/healthz").status_code == 200


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000, b'{"model_id": ' + b"9" * 5000 + b"}"],
                         ids=["nested", "5000-digit-int"])
def test_hostile_json_is_a_user_error(srv, body):
    json_headers = {"Content-Type": "application/json"}
    with raw_client(srv) as http:
        fut = http.post("/api/v1/optim_step", content=body, headers=json_headers)
        assert fut.status_code == 200
        assert "not valid JSON" in _user_error(http, fut.json()) or "nested too deeply" in _user_error(
            http, fut.json())
        direct = http.post("/api/v1/create_session", content=body, headers=json_headers)
        assert direct.status_code == 400, direct.text


# ---- a rejected request registers nothing -----------------------------------------------------------
def _own_threads() -> int:
    """Threads but the event loop's default executor's (``asyncio.to_thread`` starts its workers
    lazily, up to a fixed pool: the state-dir calls run there, so its size says nothing of a leak)."""
    return sum(not t.name.startswith("asyncio_") for t in threading.enumerate())


def test_rejected_create_model_registers_nothing(srv):
    rt = srv.runtime
    with raw_client(srv) as http:
        models, threads = len(rt.models), _own_threads()
        for _ in range(5):
            fut = http.post("/api/v1/create_model", json={"session_id": "bad/sess", "model_seq_id": 0,
                                                           "base_model": "tiny"}).json()
            assert "invalid session id" in _user_error(http, fut)
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        for body in ({"base_model": "nope"}, {"base_model": "tiny", "lora_config": {"rank": -1}},
                     {"base_model": "tiny", "optimizer_config": {"type": "sgd"}}):
            fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 3, **body}).json()
            _user_error(http, fut)
            again = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 3, **body}).json()
            _user_error(http, again)  # a retry fails the same way at once (never try_again forever)
        assert len(rt.models) == models and _own_threads() <= threads
        assert http.post("/api/v1/get_info", json={"model_id": f"{sid}:train:3"}).status_code == 404


# ---- names, paths, late retries -------------------------------------------------------------------------
def test_checkpoint_name_fullmatch_and_tinker_paths_in_errors(srv, model):
    root = str(srv.runtime.store.root)
    with raw_client(srv) as http:
        bad = http.post("/api/v1/save_weights", json={"model_id": model[1], "path": "name\n"}).json()
        assert "invalid checkpoint name" in _user_error(http, bad)
        first = http.post("/api/v1/save_weights", json={"model_id": model[1], "path": "twice"}).json()
        assert wait_result(http, first["request_id"]).json()["path"] == f"tinker://{model[1]}/weights/twice"
        second = http.post("/api/v1/save_weights", json={"model_id": model[1], "path": "twice"}).json()
        error = _user_error(http, second)
        assert "already exists" in error and f"tinker://{model[1]}/weights/twice" in error and root not in error
    assert srv.runtime.redact(f"cannot open {root}/scratch/x/y") == "cannot open <state-dir>/..."


@pytest.mark.parametrize("route, body, says", [
    ("save_weights_for_sampler", {}, "needs a path (a name) or a sampling_session_seq_id"),
    ("save_weights_for_sampler", {"sampling_session_seq_id": "1"},
     f"sampling_session_seq_id: expected an integer in 0..{2**63 - 1}, got '1'"),
    ("save_weights_for_sampler", {"sampling_session_seq_id": 1, "kind": "frozen"}, "unknown kind 'frozen'"),
    ("save_weights_for_sampler", {"path": "x", "ttl_seconds": 0}, "ttl_seconds: expected an integer in 3600..315360000"),
    ("save_weights", {"path": "x", "ttl_seconds": 10**12}, "ttl_seconds: expected an integer in 3600..315360000"),
    ("save_weights_external", {"path": "x", "ttl_seconds": 7200.5}, "ttl_seconds: expected an integer in 3600.."),
    ("load_weights", {"path": "tinker://x/weights/y", "optimizer": "yes"}, "optimizer: expected true or false"),
    ("load_weights", {"path": 3}, "expected a tinker:// path, got 3"),
])
def test_bad_save_and_load_fields_are_user_errors_naming_them(srv, model, route, body, says):
    with raw_client(srv) as http:
        answer = http.post(f"/api/v1/{route}", json={"model_id": model[1], **body}).json()
        assert says in _user_error(http, answer)


def test_a_save_ttl_far_in_the_future_is_refused_and_every_listing_answers(srv, model):
    """Issue 41, item 13. Before: ttl_seconds=1e12 on a save was acknowledged (a save took any
    positive number), then every listing of the owner was a 500 ("year 33715 is out of
    range"). Now saves and PUT .../ttl share one rule: whole seconds, one hour to ten years."""
    with raw_client(srv) as http:
        answer = http.post("/api/v1/save_weights", json={"model_id": model[1], "path": "far", "ttl_seconds": 1e12}).json()
        assert "ttl_seconds: expected an integer in 3600..315360000, got 1000000000000.0" in _user_error(http, answer)
        for path in ("/api/v1/checkpoints", "/api/v1/training_runs", f"/api/v1/training_runs/{model[1]}/checkpoints",
                     "/console/api/runs"):
            assert http.get(path).status_code == 200, path
        assert http.post("/api/v1/sessions/search", json={}).status_code == 200
        assert "far" not in str(http.get("/api/v1/checkpoints").json())


#: an integer of 400 digits, as JSON text (json.dumps writes Python's big integers as they are)
HUGE = 10**400


def test_integers_of_309_digits_and_more_are_refused_naming_the_field(srv, model):
    """Issue 41, item 15. Before: each was a bare 500 (math.isfinite overflows on an integer
    past 1e308) where a smaller bad value got a 400 or a user error naming its field."""
    sid, model_id = model
    with raw_client(srv) as http:
        saved = http.post("/api/v1/save_weights", json={"model_id": model_id, "path": "ttl-target"}).json()
        wait_result(http, saved["request_id"])
        ttl = http.put(f"/api/v1/training_runs/{model_id}/checkpoints/weights/ttl-target/ttl",
                       json={"ttl_seconds": HUGE})
        assert ttl.status_code == 400 and ttl.json()["detail"].startswith("ttl_seconds: expected an integer in 3600.."), \
            ttl.text
        search = http.post("/api/v1/sessions/search", json={"limit": HUGE})
        assert search.status_code == 400 and search.json()["detail"].startswith("limit: expected an integer in 1..200")
        sampling = http.post("/api/v1/create_sampling_session", json={"session_id": sid, "base_model": "tiny",
                                                                       "sampling_session_seq_id": HUGE})
        assert sampling.status_code == 400, sampling.text
        assert sampling.json()["detail"].startswith("sampling_session_seq_id: expected an integer in 0..")
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
        sample = {"base_model": "tiny", "prompt": prompt, "num_samples": 1}
        for route, body, says in (
                ("optim_step", {"model_id": model_id, "seq_id": HUGE}, "seq_id: expected an integer in "),
                ("optim_step", {"model_id": model_id, "adam_params": {"learning_rate": HUGE}},
                 "AdamParams.learning_rate: expected a finite number"),
                ("create_model", {"session_id": sid, "model_seq_id": HUGE, "base_model": "tiny"},
                 "model_seq_id: expected an integer in "),
                ("create_model", {"session_id": sid, "model_seq_id": 9, "base_model": "tiny",
                                  "lora_config": {"rank": HUGE}}, "LoraConfig.rank: expected an integer in 1.."),
                ("create_model", {"session_id": sid, "model_seq_id": 9, "base_model": "tiny",
                                  "lora_config": {"rank": 2, "seed": HUGE}}, "LoraConfig.seed: expected an integer in "),
                ("asample", {**sample, "sampling_params": {"max_tokens": 1}, "seq_id": -HUGE},
                 "seq_id: expected an integer in "),
                ("asample", {**sample, "sampling_params": {"max_tokens": 1, "stop": [HUGE]}},
                 "SamplingParams.stop[0]: expected an integer in "),
                ("asample", {**sample, "sampling_params": {"max_tokens": HUGE}},
                 "SamplingParams.max_tokens: expected an integer in ")):
            answer = http.post(f"/api/v1/{route}", json=body)
            assert answer.status_code == 200, (route, answer.text)
            assert _user_error(http, answer.json()).startswith(says), route
        assert len(str(HUGE)) == 401 and len(ttl.text) < 400  # the value is never echoed whole


@pytest.mark.parametrize("statuses", [["active"], "active", [None], 5, {"type": "active"}, [],
                                      [{"type": "paused"}], [{"type": "active", "reasons": ["success"]}],
                                      [{"type": "client_finished", "reasons": "success"}]])
def test_a_malformed_session_search_status_is_a_400_naming_it(srv, statuses):
    """Issue 41, item 16. Before: each of these was a 500 (the search read them as objects)."""
    with raw_client(srv) as http:
        answer = http.post("/api/v1/sessions/search", json={"statuses": statuses})
    assert answer.status_code == 400, answer.text
    assert answer.json()["detail"].startswith("statuses"), answer.text


def test_retry_after_its_record_expired_is_refused(srv, model):
    rt = srv.runtime
    with raw_client(srv) as http:
        body = {"model_id": model[1], "seq_id": 1, "adam_params": {"learning_rate": 1e-4}}
        first = http.post("/api/v1/optim_step", json=body).json()
        assert "metrics" in wait_result(http, first["request_id"]).json()
        assert http.post("/api/v1/optim_step", json=body).json()["request_id"] == first["request_id"]

        async def sweep():
            rt.futures.retention_s = -1
            rt.futures.sweep()
            rt.futures.retention_s = 900.0

        asyncio.run_coroutine_threadsafe(sweep(), rt.loop).result(HANG_S)
        late = http.post("/api/v1/optim_step", json=body).json()
        assert late["request_id"] != first["request_id"]
        error = _user_error(http, late)
        assert "expired" in error and "not running it again" in error and f"model {model[1]} seq_id 1" in error


def test_expired_retry_keys_stay_bounded():
    """The keys of swept records are remembered within a horizon and up to a cap, not forever."""
    from skyrl_sdk.errors import InputError
    from skyrl_sdk.server.compute.futures import FutureStore, Result

    loop = asyncio.new_event_loop()
    store = FutureStore(loop, retention_s=0.0, expired_horizon_s=3600.0, max_expired=50)
    key = lambda i: ("alice", "optim_step", "model-1", i)  # noqa: E731
    for i in range(500):  # one request per seq_id, retrieved long ago, then swept
        rec = store.create("alice", "model-1", key(i))
        store.finish(rec, Result.json({}))
        rec.retrieved_at = time.time() - 1
        store.sweep()
        assert store.expired_keys <= 50 and len(store) == 0
    for i in (499, 450):  # recent: a retry is refused as expired
        with pytest.raises(InputError, match="expired"):
            store.lookup(key(i))
    assert store.lookup(key(449)) is None  # beyond the cap: forgotten (the oldest first)
    store.expired_horizon_s = 0.01
    time.sleep(0.05)
    store.sweep()
    assert store.expired_keys == 0 and store.lookup(key(499)) is None  # past the horizon: forgotten
    loop.close()


# ---- idle sessions are reaped ---------------------------------------------------------------------------
def test_sessions_without_heartbeat_are_reaped(tmp_path):
    # heartbeats 0.3 s apart against a 60 s timeout: none can be late, however loaded the machine
    with ServerThread(tmp_path / "state", session_timeout_s=60) as server, raw_client(server) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        model_id = wait_result(http, fut["request_id"]).json()["model_id"]
        for _ in range(4):  # heartbeats keep it alive
            time.sleep(0.3)
            assert http.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        model = server.runtime.models[model_id]
        assert not model.closed
        sessions = server.runtime.sessions
        server.runtime.loop.call_soon_threadsafe(sessions.seen, sid, time.monotonic() - 61)
        server.runtime.loop.call_soon_threadsafe(sessions.reap)  # then silence: the next sweep ends it
        deadline = time.monotonic() + HANG_S
        while model.backend is not None or not model.closed:
            assert time.monotonic() < deadline, "the idle session was not reaped"
            time.sleep(0.1)
        late = http.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {}}).json()
        assert "session expired" in _user_error(http, late)
        again = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 1,
                                                         "base_model": "tiny"}).json()
        assert f"session {sid} expired" in _user_error(http, again)
        assert http.get(f"/api/v1/sessions/{sid}").json()["finished_at"] is not None
        ended = http.post("/api/v1/session_heartbeat", json={"session_id": sid})
        assert ended.status_code == 410 and "expired" in ended.json()["detail"]  # the client stops heartbeating


def test_config_from_cli_flags(tmp_path):
    from skyrl_sdk.cli.commands import build_parser
    from skyrl_sdk.server.config import ServerConfig

    keys = tmp_path / "keys"
    keys.write_text(f"{API_KEY} alice\n")
    args = build_parser().parse_args(["serve", "--api-keys", str(keys), "--session-timeout", "30",
                                      "--max-seq-len", "512", "--max-num-samples", "4"])
    config = ServerConfig.from_args(args)
    assert (config.api_keys, config.session_timeout_s, config.max_seq_len, config.max_num_samples) == (
        {API_KEY: "alice"}, 30.0, 512, 4)
    assert ServerConfig().session_timeout_s == 300.0
    # one shared base per model unless asked otherwise
    assert config.share_base and ServerConfig().share_base
    assert ServerConfig.from_args(build_parser().parse_args(["serve", "--share-base"])).share_base
    assert not ServerConfig.from_args(build_parser().parse_args(["serve", "--no-share-base"])).share_base


def test_server_start_cleans_interrupted_saves_and_protects_its_state_dir(tmp_path):
    import subprocess
    import sys

    from skyrl_sdk import errors
    from skyrl_sdk.models import checkpoint

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    nested = tmp_path / "checkpoints" / "run-1"
    nested.mkdir(parents=True)
    leftover = nested / f".ckpt.skyrl-tmp-{proc.pid}-0a1b"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"0" * 100)
    unrelated = nested / ".notes"
    unrelated.mkdir()
    with ServerThread(tmp_path / "") as srv:
        assert srv.runtime is not None
    assert not leftover.exists() and unrelated.exists()
    with pytest.raises(errors.CheckpointError):
        with checkpoint.atomic_directory(tmp_path, overwrite=True):
            pass


# ---- the size of one request, and of one owner's queue ------------------------------------------------
def test_a_request_over_the_token_limit_is_refused_naming_it(srv, model):
    msg = _datum_msg(model[1], 60)
    for _ in range(3):
        msg.data.append(msg.data[0])  # 4 x 60 = 240 tokens
    with raw_client(srv) as http:
        fut = http.post("/api/v1/forward_backward", content=msg.SerializeToString(), headers=PROTO).json()
        error = _user_error(http, fut)
        assert "240 tokens" in error and "--max-tokens-per-request" in error and str(MAX_TOKENS) in error
        assert http.post("/api/v1/client/config", json={}).json()["fwdbwd_max_chunk_bytes_count"] == 12 * MAX_TOKENS


def test_the_tinker_client_cuts_a_big_batch_below_the_token_limit(srv):
    service = srv.service_client()
    tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
    datums = [next_token_datum(50)] * 8  # 400 tokens: sent in chunks of <= 200
    out = tc.forward_backward(datums, "cross_entropy").result(timeout=HANG_S)
    assert len(out.loss_fn_outputs) == 8 and np.isfinite(out.metrics["loss:sum"])
    service.close("success").result()


def test_an_owners_queue_bound_refuses_up_front_and_spares_other_owners(tmp_path):
    from skyrl_sdk.server.compute.futures import Job, Result

    keys = {"tml-bob-0123456789abc": "bob"}
    with ServerThread(tmp_path / "state", max_queued_requests=3, api_keys=keys) as server:
        with raw_client(server) as http, raw_client(server, "tml-bob-0123456789abc") as bob:
            models = []
            for client in (http, bob):
                sid = client.post("/api/v1/create_session", json={}).json()["session_id"]
                fut = client.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                                 "base_model": "tiny", "lora_config": {"rank": 2}}).json()
                models.append(wait_result(client, fut["request_id"]).json()["model_id"])
            release = threading.Event()
            server.runtime.executors.shared.queue("blocker", "zed").put(Job(
                run=lambda: Result.json({"held": release.wait(60)}), done=lambda r: None))
            step = {"model_id": models[0], "adam_params": {"learning_rate": 1e-4}}
            accepted = [http.post("/api/v1/optim_step", json={**step, "seq_id": i}).json() for i in (1, 2, 3)]
            refused = http.post("/api/v1/optim_step", json={**step, "seq_id": 4}).json()
            error = _user_error(http, refused)
            assert "--max-queued-requests" in error and "3 of yours" in error
            other = bob.post("/api/v1/optim_step", json={"model_id": models[1], "adam_params": {}}).json()
            release.set()
            for answer in accepted:
                assert "metrics" in wait_result(http, answer["request_id"]).json()
            assert "metrics" in wait_result(bob, other["request_id"]).json()
            again = http.post("/api/v1/optim_step", json={**step, "seq_id": 4}).json()  # room again
            assert "metrics" in wait_result(http, again["request_id"]).json()


# ---- what errors quote, and what failures keep --------------------------------------------------------
def test_errors_quote_at_most_about_100_characters_of_a_value(srv):
    huge = "m" * 500_000
    with raw_client(srv) as http:
        answer = http.post("/api/v1/optim_step", json={"model_id": huge, "adam_params": {}}).json()
        failed = wait_result(http, answer["request_id"])
        assert len(failed.content) < 1000 and "(500000 characters)" in failed.json()["error"]
        direct = http.post("/api/v1/get_info", json={"model_id": huge})
        assert direct.status_code == 404 and len(direct.content) < 1000
        query = http.get("/api/v1/sessions", params={"limit": "9" * 5000})
        assert query.status_code == 400 and "limit" in query.json()["detail"] and len(query.content) < 1000


def test_failed_results_kept_are_bounded_in_bytes():
    from skyrl_sdk.errors import InputError
    from skyrl_sdk.server.compute.futures import FutureStore, Result

    async def main():
        store = FutureStore(asyncio.get_running_loop(), max_failed_bytes=10 * (FutureStore.RECORD_BYTES + 200))
        kept = store.create("alice", "m", dedup_key=("alice", "model", "m", "seq_id", 1))
        store.finish(kept, Result.error("first", "user"))
        ids = [store.failed("alice", InputError(f"bad {i}")).request_id for i in range(50)]
        assert store.failed_bytes <= store.max_failed_bytes and len(store) <= 12  # of 51
        assert (await store.wait("alice", ids[0], 0))[0] is None  # the oldest went first
        assert (await store.wait("alice", ids[-1], 0))[1].failed  # the newest are kept
        with pytest.raises(InputError, match="expired"):  # a dropped one is never run again
            store.lookup(("alice", "model", "m", "seq_id", 1))
        assert store.pending("alice") == 0

    asyncio.run(main())
