"""``skyrl-sdk serve`` driven by the unmodified official ``tinker`` client over loopback.

One server (uvicorn in a thread, model ``tiny``) serves the whole module. Numbers that
come back through the client are compared with an in-process :class:`Backend` built
the same way, so every check covers the wire format as well as the semantics.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from _limits import HANG_S
from _server_harness import API_KEY, ServerThread
from skyrl_sdk import Backend, types
from skyrl_sdk.testing import make_rl_data, make_sft_data

RANK, LORA_SEED = 4, 7
CHUNK = 2  # the server tells the client to send at most 2 datums per forward_backward request


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), client_config={"fwdbwd_max_chunk_len": CHUNK},
                      max_body_bytes=4 * 2**20) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server):
    sc = server.service_client()
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def reference():
    """A fresh in-process model identical to a freshly created server model (forward only)."""
    with Backend(model="tiny", lora=types.LoraConfig(rank=RANK, seed=LORA_SEED)) as b:
        yield b


def new_trainer(service):
    return service.create_lora_training_client(base_model="tiny", rank=RANK, seed=LORA_SEED).result()


def to_tinker(d: types.Datum, sparse: tuple[str, ...] = (), chunks: int = 1) -> tt.Datum:
    tokens = d.model_input.to_ints()
    bounds = np.linspace(0, len(tokens), chunks + 1).astype(int)
    model_input = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=tokens[a:b])
                                        for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    inputs = {
        k: tt.TensorData.from_torch_sparse(torch.from_numpy(v.array)) if k in sparse
        else tt.TensorData.from_numpy(v.array)
        for k, v in d.loss_fn_inputs.items()
    }
    return tt.Datum(model_input=model_input, loss_fn_inputs=inputs)


def assert_outputs_close(got, want, atol=1e-5):
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].array, atol=atol)
    np.testing.assert_allclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rtol=1e-5, atol=1e-4)


# ---- training ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_cross_entropy_train_steps_match_in_process(service):
    """5 datums -> 3 chunks whose gradients add up; AdamW honoured; weights match."""
    data = make_sft_data([7, 12, 3, 20, 9], seed=1)
    adam = dict(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.01, grad_clip_norm=5.0)
    tc = new_trainer(service)
    with Backend(model="tiny", lora=types.LoraConfig(rank=RANK, seed=LORA_SEED)) as ref:
        for _ in range(2):
            got = tc.forward_backward([to_tinker(d) for d in data], "cross_entropy")
            got_step = tc.optim_step(tt.AdamParams(**adam))
            want = ref.forward_backward(data, "cross_entropy")
            want_step = ref.optim_step(types.AdamParams(**adam))
            assert_outputs_close(got.result(), want)
            step = got_step.result().metrics
            np.testing.assert_allclose(step["grad_norm"], want_step.metrics["grad_norm"], rtol=1e-4)
            assert step["num_forward_backward_calls"] == 3  # the chunks arrived as 3 requests
        assert_outputs_close(tc.forward([to_tinker(d) for d in data], "cross_entropy").result(),
                             ref.forward(data, "cross_entropy"))


def test_sparse_csr_tensors_and_multi_chunk_prompts(service, reference):
    """Top-K targets with a sparse CSR weight tensor and 3-chunk prompts give the dense result."""
    rng = np.random.default_rng(3)
    data = []
    for n in (6, 9):
        weights = np.zeros((n, 8), np.float32)
        weights[np.arange(n), rng.integers(0, 8, n)] = 1.0
        data.append(types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 256, n)),
                                loss_fn_inputs={"target_tokens": rng.integers(0, 256, (n, 8)), "weights": weights}))
    tc = new_trainer(service)
    wire_data = [to_tinker(d, sparse=("weights",), chunks=3) for d in data]
    assert wire_data[0].loss_fn_inputs["weights"].sparse_crow_indices is not None
    got = tc.forward(wire_data, "cross_entropy").result()
    want = reference.forward(data, "cross_entropy")
    assert got.loss_fn_outputs[0]["logprobs"].shape == [6, 8]
    assert_outputs_close(got, want)


@pytest.mark.parametrize("loss_fn,config", [
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("dro", {"beta": 0.1}),
    ("gspo", None),
])
def test_policy_losses_match_in_process(service, reference, loss_fn, config):
    data = make_rl_data([10, 14, 6], seed=2)
    tc = new_trainer(service)
    got = tc.forward_backward([to_tinker(d) for d in data], loss_fn, config).result()
    assert_outputs_close(got, reference.forward(data, loss_fn, config))
    assert tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0


def test_plugin_loss_by_name(service, reference):
    pytest.importorskip("skyrl_sdk_reinforce")
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "advantages": d.loss_fn_inputs["advantages"]})
        for d in make_rl_data([8, 5], seed=4)]
    got = new_trainer(service).forward_backward([to_tinker(d) for d in data], "reinforce").result()
    assert_outputs_close(got, reference.forward(data, "reinforce"))


def test_forward_only_adds_no_gradient(service):
    tc = new_trainer(service)
    data = [to_tinker(d) for d in make_sft_data([5, 6], seed=5)]
    first = tc.forward(data, "cross_entropy").result()
    step = tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm"] == 0.0
    again = tc.forward(data, "cross_entropy").result()
    np.testing.assert_array_equal(first.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                  again.loss_fn_outputs[0]["logprobs"].to_numpy())


def test_forward_backward_custom_equals_cross_entropy(service):
    data = make_sft_data([6, 11, 4], seed=6)
    wire = [to_tinker(d) for d in data]

    def nll(batch, logprobs_list):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
                   for d, lp in zip(batch, logprobs_list, strict=True))
        return loss, {"custom:sum": float(loss.detach())}

    a, b = new_trainer(service), new_trainer(service)
    custom = a.forward_backward_custom(wire, nll).result()
    plain = b.forward_backward(wire, "cross_entropy").result()
    np.testing.assert_allclose(custom.metrics["loss:sum"], plain.metrics["loss:sum"], rtol=1e-5)
    ga = a.optim_step(tt.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"]
    gb = b.optim_step(tt.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"]
    np.testing.assert_allclose(ga, gb, rtol=1e-5)


# ---- state ---------------------------------------------------------------------------------
def test_save_state_and_create_from_state(service, server):
    data = [to_tinker(d) for d in make_sft_data([8, 6], seed=7)]
    adam = tt.AdamParams(learning_rate=1e-2)
    tc = new_trainer(service)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam)
    saved = tc.save_state("step2").result()
    assert saved.path == f"tinker://{tc.model_id}/weights/step2"
    exported = tc.save_weights_for_sampler("step2").result()
    prompt, params = tt.ModelInput.from_ints([5, 6, 7]), tt.SamplingParams(max_tokens=5, seed=2)
    via_state, via_export = (service.create_sampling_client(model_path=p).result().sample(prompt, 1, params).result()
                             for p in (saved.path, exported.path))
    assert via_state.sequences[0].tokens == via_export.sequences[0].tokens
    np.testing.assert_allclose(via_state.sequences[0].logprobs, via_export.sequences[0].logprobs, atol=1e-4)
    at_save = tc.forward(data, "cross_entropy").result()
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam).result()
    continued = tc.forward(data, "cross_entropy").result()

    plain = service.create_training_client_from_state(saved.path).result()
    assert_outputs_close(plain.forward(data, "cross_entropy").result(), _as_ref(at_save))
    with_opt = service.create_training_client_from_state_with_optimizer(saved.path).result()
    for client in (plain, with_opt):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(adam).result()
    # the optimizer moments came along: the third step lands exactly where the original's did
    assert_outputs_close(with_opt.forward(data, "cross_entropy").result(), _as_ref(continued))
    fresh_moments = plain.forward(data, "cross_entropy").result()
    assert abs(fresh_moments.metrics["loss:sum"] - continued.metrics["loss:sum"]) > 1e-3

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    ids = {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert "weights/step2" in ids
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        tc.save_state("step2").result()


def _as_ref(out):
    """A client ForwardBackwardOutput in the shape assert_outputs_close expects as 'want'."""
    return types.ForwardBackwardOutput(
        loss_fn_output_type=out.loss_fn_output_type,
        loss_fn_outputs=[{k: types.TensorData(v.to_numpy()) for k, v in o.items()} for o in out.loss_fn_outputs],
        metrics=dict(out.metrics),
    )


def test_checkpoint_names_cannot_escape_state_dir(service, server):
    tc = new_trainer(service)
    for bad in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(tinker.RequestFailedError, match="invalid checkpoint name"):
            tc.save_state(bad).result(timeout=HANG_S)
    for bad in ("tinker://../weights/x", "tinker://x/weights/../../etc", "file:///etc/passwd"):
        with pytest.raises(tinker.RequestFailedError):
            service.create_training_client_from_state(bad).result(timeout=HANG_S)
    assert not any(p.name == "escape" for p in server.config.state_dir.parent.rglob("escape"))


# ---- sampling --------------------------------------------------------------------------------
def test_sampling_logprobs_agree_with_forward(service):
    tc = new_trainer(service)
    data = [to_tinker(d) for d in make_sft_data([10, 7], seed=8, shifted=True)]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(tt.AdamParams(learning_rate=2e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [72, 101, 108, 108, 111, 32]
    res = sampler.sample(tt.ModelInput.from_ints(prompt), 3, tt.SamplingParams(max_tokens=12, seed=11)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        full = prompt + list(seq.tokens)
        datum = tt.Datum(model_input=tt.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": tt.TensorData.from_numpy(np.array(full[1:])),
            "weights": tt.TensorData.from_numpy(np.ones(len(full) - 1, np.float32))})
        lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(np.array(seq.logprobs), lp[len(prompt) - 1:], atol=1e-3)
    # many concurrent requests (batched server-side) each get their own num_samples sequences
    many = [sampler.sample(tt.ModelInput.from_ints(prompt[:k]), 2, tt.SamplingParams(max_tokens=4))
            for k in range(2, 7)]
    assert [len(f.result().sequences) for f in many] == [2] * 5
    # compute_logprobs = a max_tokens=1 sample with prompt_logprobs
    lps = sampler.compute_logprobs(tt.ModelInput.from_ints(prompt + [33, 33])).result()
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(prompt + [33]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array(prompt[1:] + [33, 33])),
        "weights": tt.TensorData.from_numpy(np.ones(len(prompt) + 1, np.float32))})
    want = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lps[0] is None
    np.testing.assert_allclose(np.array(lps[1:], dtype=np.float32), want, atol=1e-3)


def test_snapshot_sampler_keeps_its_weights_after_training(service):
    tc = new_trainer(service)
    data = [to_tinker(d) for d in make_sft_data([9, 9], seed=9)]
    params = tt.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
    prompt = tt.ModelInput.from_ints([1, 2, 3, 4])
    before = tc.save_weights_and_get_sampling_client().result()
    first = before.sample(prompt, 1, params).result()
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result()
    again = before.sample(prompt, 1, params).result()  # served from the exported snapshot
    assert again.sequences[0].tokens == first.sequences[0].tokens
    np.testing.assert_allclose(again.sequences[0].logprobs, first.sequences[0].logprobs, atol=1e-4)
    after = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
    assert not np.allclose(after.sequences[0].logprobs, first.sequences[0].logprobs, atol=1e-4)


def test_sampling_params_stop_and_paths(service, server):
    tc = new_trainer(service)
    saved = tc.save_weights_for_sampler("sampler0").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/sampler0"
    from_path = service.create_sampling_client(model_path=saved.path).result()
    from_base = service.create_sampling_client(base_model="tiny").result()
    live = tc.save_weights_and_get_sampling_client().result()
    prompt = tt.ModelInput.from_ints([10, 20, 30])
    params = tt.SamplingParams(max_tokens=8, seed=5, temperature=0.7, top_k=50, top_p=0.9)
    seqs = [c.sample(prompt, 2, params).result().sequences for c in (from_path, from_base, live)]
    for other in seqs[1:]:  # a fresh LoRA model equals its base; the exported copy equals both
        assert [s.tokens for s in other] == [s.tokens for s in seqs[0]]
        np.testing.assert_allclose([s.logprobs for s in other], [s.logprobs for s in seqs[0]], atol=1e-4)
    # stop token ids and strings cut the sequence and report "stop"
    greedy = live.sample(prompt, 1, tt.SamplingParams(max_tokens=10, temperature=0.0)).result().sequences[0]
    stop_tok = greedy.tokens[3]
    cut = live.sample(prompt, 1, tt.SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_tok])).result()
    assert cut.sequences[0].stop_reason == "stop"
    assert cut.sequences[0].tokens == greedy.tokens[:greedy.tokens.index(stop_tok) + 1]
    tok = tc.get_tokenizer()
    text = tok.decode(greedy.tokens[:4])
    if text.strip():
        by_str = live.sample(prompt, 1, tt.SamplingParams(max_tokens=10, temperature=0.0,
                                                           stop=[text[-1]])).result().sequences[0]
        assert by_str.stop_reason == "stop" and len(by_str.tokens) <= 4
    info = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    assert info.get_training_run(tc.model_id).result().base_model == "tiny"


def test_a_sampling_option_out_of_range_is_a_user_error(service):
    sampler = service.create_sampling_client(base_model="tiny").result()
    with pytest.raises(tinker.RequestFailedError, match="topk_sample_logprobs: expected an integer in 0..20"):
        sampler.sample(tt.ModelInput.from_ints([1, 2, 3]), 1, tt.SamplingParams(max_tokens=2),
                       topk_sample_logprobs=21).result(timeout=HANG_S)


# ---- errors ----------------------------------------------------------------------------------
def test_bad_datum_fails_fast_and_model_stays_usable(service):
    tc = new_trainer(service)
    good = [to_tinker(d) for d in make_sft_data([5], seed=10)]
    bad = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array([4, 5, 99999])),
        "weights": tt.TensorData.from_numpy(np.ones(3, np.float32))})
    with pytest.raises(tinker.RequestFailedError) as err:  # a user error: the client does not retry
        tc.forward_backward(good + [bad], "cross_entropy").result(timeout=HANG_S)
    assert "datum" in str(err.value) and "target_tokens" in str(err.value) and "99999" in str(err.value)
    assert err.value.category == tt.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="unknown"):
        tc.forward_backward(good, "no_such_loss").result(timeout=HANG_S)
    out = tc.forward_backward(good, "cross_entropy").result(timeout=HANG_S)
    assert out.metrics["loss:sum"] > 0
    assert tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics["grad_norm"] > 0


# ---- raw HTTP: ordering, de-duplication, auth, limits -----------------------------------------------
def _raw(server):
    return httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY}, timeout=HANG_S)


def _raw_model(http) -> str:
    sid = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
    fut = http.post("/api/v1/create_model", json={"session_id": sid["session_id"], "model_seq_id": 0,
                                                   "base_model": "tiny", "lora_config": {"rank": 2}}).json()
    assert _result(http, fut["request_id"]).json()["model_id"] == fut["model_id"]
    return fut["model_id"]


def _result(http, request_id):
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True})
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r


def _fwdbwd_body(model_id, seq_id) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1, 2, 3, 4], np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.array([2, 3, 4, 5]).tobytes(),
                                                          dtype=pb.DTYPE_INT64, shape=[4]))
    d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(4, np.float32).tobytes(),
                                                    dtype=pb.DTYPE_FLOAT32, shape=[4]))
    return msg.SerializeToString()


def test_replayed_seq_id_runs_once_and_order_is_kept(server):
    with _raw(server) as http:
        model_id = _raw_model(http)
        info = http.post("/api/v1/get_info", json={"model_id": model_id}).json()
        assert (info["is_lora"], info["lora_rank"], info["sampler"]) == (True, 2, "transformers")  # which sampler serves
        proto = {"Content-Type": "application/x-protobuf"}
        # optim_step (seq 2) arrives before the forward_backward (seq 1) it must follow
        optim = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                      "adam_params": {"learning_rate": 1e-3}}).json()
        first = http.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1), headers=proto).json()
        replay = http.post("/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1), headers=proto).json()
        assert replay["request_id"] == first["request_id"]
        out = _result(http, first["request_id"])
        assert out.headers["content-type"] == "application/x-protobuf"
        parsed = pb.ForwardBackwardOutput.FromString(out.content)
        assert parsed.metrics["loss:sum"] > 0 and parsed.loss_fn_outputs[0].num_datums == 1
        metrics = _result(http, optim["request_id"]).json()["metrics"]
        assert metrics["num_forward_backward_calls"] == 1.0  # ran once, and before the step
        again = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                      "adam_params": {"learning_rate": 1e-3}}).json()
        assert again["request_id"] == optim["request_id"]
        unknown = _result(http, "req-nope").json()
        assert unknown["category"] == "server" and "unknown request_id" in unknown["error"]


def test_event_loop_stays_responsive_while_training(server):
    """healthz is answered while a forward_backward holds the model's worker: the training
    waits for that answer, so a blocked event loop would show as an answer after it."""
    with _raw(server) as http:
        model_id = _raw_model(http)
        backend = server.runtime.models[model_id].require_backend()
        started, answered, finished = threading.Event(), threading.Event(), threading.Event()
        real = backend.forward_backward_steps  # what the server's job runs, step by step

        def held(*args, **kwargs):
            started.set()
            answered.wait(HANG_S)
            out = yield from real(*args, **kwargs)
            finished.set()
            return out

        backend.forward_backward_steps = held
        big = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
        rng = np.random.default_rng(0)
        for _ in range(16):
            d = big.data.add()
            d.model_input.add().encoded_text.tokens = rng.integers(0, 256, 256).astype(np.int32).tobytes()
            d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(
                dense=rng.integers(0, 256, 256).astype(np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[256]))
        try:
            fut = http.post("/api/v1/forward_backward", content=big.SerializeToString(),
                            headers={"Content-Type": "application/x-protobuf"}).json()
            assert started.wait(HANG_S)
            assert http.get("/api/v1/healthz").json() == {"status": "ok"}
            assert not finished.is_set()  # answered while the training was still held
        finally:
            answered.set()
        assert _result(http, fut["request_id"]).status_code == 200
        del backend.forward_backward_steps


def test_two_clients_at_once(server):
    data = make_sft_data([6, 8, 10], seed=12)
    results: dict[int, float] = {}
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            sc = server.service_client()
            tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=LORA_SEED).result()
            for _ in range(3):
                tc.forward_backward([to_tinker(d) for d in data], "cross_entropy")
                tc.optim_step(tt.AdamParams(learning_rate=1e-2))
            results[i] = tc.forward([to_tinker(d) for d in data], "cross_entropy").result().metrics["loss:sum"]
            sc.close("success").result()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not errors, errors
    assert results[0] == pytest.approx(results[1], rel=1e-6)  # same start, same data, same result


def test_auth_is_required(server):
    with httpx.Client(base_url=server.url, timeout=HANG_S) as http:
        assert http.post("/api/v1/create_session", json={}).status_code == 401
        assert http.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
        ok = http.post("/api/v1/create_session", json={}, headers={"x-api-key": API_KEY})
        assert ok.status_code == 200 and ok.json()["session_id"]
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}
        assert http.post("/api/v1/telemetry", json={"events": []}, headers={"X-API-KEY": API_KEY}).status_code == 200
    with pytest.raises(Exception) as err:
        server.service_client(api_key="tml-wrong").create_lora_training_client(base_model="tiny", rank=RANK)
    assert "401" in str(err.value) or "X-API-Key" in str(err.value)


def test_body_size_limit(server):
    with _raw(server) as http:
        r = http.post("/api/v1/forward_backward", content=b"\0" * (5 * 2**20),
                      headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 413


def test_unknown_base_model_and_bad_json_are_user_errors(service, server):
    with pytest.raises(tinker.RequestFailedError, match="not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=RANK).result(timeout=HANG_S)
    with _raw(server) as http:
        fut = http.post("/api/v1/optim_step", content=b"{not json", headers={"Content-Type": "application/json"})
        assert fut.status_code == 200
        assert _result(http, fut.json()["request_id"]).json()["category"] == "user"


def test_restart_keeps_checkpoints(tmp_path):
    data = [to_tinker(d) for d in make_sft_data([7, 5], seed=13)]
    with ServerThread(tmp_path / "state") as srv:
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=LORA_SEED).result()
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(tt.AdamParams(learning_rate=1e-2))
        path = tc.save_state("kept").result().path
        sampler_path = tc.save_weights_for_sampler("kept-sampler").result().path
        want = tc.forward(data, "cross_entropy").result()
        run_id = tc.model_id
        sc.close("success").result()
    with ServerThread(tmp_path / "state") as srv:
        sc = srv.service_client()
        rest = tinker.RestClient(base_url=srv.url, api_key=API_KEY)
        ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert ids == {"weights/kept", "sampler_weights/kept-sampler"}
        assert any(r.training_run_id == run_id for r in rest.list_training_runs().result().training_runs)
        tc = sc.create_training_client_from_state_with_optimizer(path).result()
        assert_outputs_close(tc.forward(data, "cross_entropy").result(), _as_ref(want))
        assert sc.create_sampling_client(model_path=sampler_path).result().sample(
            tt.ModelInput.from_ints([1, 2]), 1, tt.SamplingParams(max_tokens=2)).result().sequences
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
        assert {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints} == {"weights/kept"}
        sc.close("success").result()


def test_store_paths_stay_inside(tmp_path):
    from skyrl_sdk.errors import InputError
    from skyrl_sdk.server.state.store import Store
    from skyrl_sdk.server.wire.tinker_paths import TinkerPath

    store = Store(tmp_path / "s")
    tp = TinkerPath.parse("tinker://sess-1:train:0/weights/ok-1.x")
    assert store.checkpoint_dir(tp).is_relative_to(store.root)
    for bad in ("tinker://../weights/x", "tinker://a/weights/..", "tinker://a/other/x", "tinker://a/weights/x/y",
                "tinker://a/weights/.x", "s3://a/weights/x", "tinker://a/weights/x\n", "tinker://a\n/weights/x"):
        with pytest.raises(InputError):
            TinkerPath.parse(bad)
    with pytest.raises(InputError):
        store.inside(tmp_path / "s" / ".." / "elsewhere")
    json.dumps(store.list_checkpoints("default")[0])
    store.add_run("sess-1:train:0", "default", "sess-1", "tiny", None, None)
    store.checkpoint_dir(tp).mkdir(parents=True)
    store.add_checkpoint(tp, ttl_seconds=0.01)
    time.sleep(0.05)
    assert store.delete_expired() == 1 and not store.checkpoint_dir(tp).exists()
    assert store.list_checkpoints("default")[1] == 0


def test_store_touch_run_writes_at_most_every_interval_and_reads_the_latest(tmp_path):
    """Every training request touches its run: the time is kept in memory, written at most every
    TOUCH_INTERVAL_S (a write is a WAL sync), read back exactly, and written on close."""
    from _sql_faults import column
    from skyrl_sdk.server.state.store import Store

    store = Store(tmp_path / "s")
    store.add_run("sess-1:train:0", "default", "sess-1", "tiny", None, None)
    store.TOUCH_INTERVAL_S = 3600.0  # the test's touches all fall in one interval, however loaded the machine
    db, query = store.root / "server.sqlite3", "SELECT last_request_time FROM training_runs WHERE run_id = ?"
    times = []
    for _ in range(5):
        before = time.time()
        store.touch_run("sess-1:train:0")
        last = store.run("sess-1:train:0", "default")["last_request_time"]
        assert before <= last <= time.time() and last >= max(times, default=0.0)  # the latest touch
        times.append(last)
    assert column(db, query, ("sess-1:train:0",)) == [times[0]]  # on disk: the first touch only
    store.close()
    assert column(db, query, ("sess-1:train:0",)) == [times[-1]]  # written on close
    again = Store(tmp_path / "s")
    assert again.run("sess-1:train:0", "default")["last_request_time"] == times[-1]
    again.close()


def test_sequencer_orders_and_skips_a_lost_seq_only_when_idle():
    """A missing seq_id is skipped only once the model's queue reports a whole gap of idleness:
    never while it is busy, however long that lasts (the queue's idleness is the test's to set,
    so no step depends on how fast the machine is)."""
    import asyncio

    from skyrl_sdk.server.compute.futures import Job, Result, Sequencer

    class Queue:  # a model's queue as the sequencer sees it
        name = "q"

        def __init__(self):
            self.put_jobs: list[str] = []
            self.idle = 0.0  # busy

        def put(self, job):
            self.put_jobs.append(job.what)

        def idle_for(self):
            return self.idle

    def job(i):
        return Job(run=lambda: Result.json({}), done=lambda r: None, what=str(i))

    async def main():
        queue = Queue()
        seq = Sequencer(queue, next_seq=1, gap_timeout_s=0.05)
        seq.submit(3, job(3))
        seq.submit(1, job(1))  # seq 2 never comes
        assert queue.put_jobs == ["1"]
        await asyncio.sleep(0.5)  # ten gaps and more while the queue is busy: nothing is skipped
        assert queue.put_jobs == ["1"] and seq.next_seq == 2
        queue.idle = 0.05  # idle for a whole gap: the next check skips 2
        deadline = time.monotonic() + HANG_S
        while len(queue.put_jobs) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return queue, seq

    queue, seq = asyncio.run(main())
    assert queue.put_jobs == ["1", "3"] and seq.next_seq == 4


def test_worker_waits_briefly_to_batch_compatible_jobs():
    """A batchable job waits up to ``batch_wait_s`` for each next compatible one (a client sends
    a group's sample requests a few ms apart, and one batch costs little more than one request);
    any other job ends the wait at once; ``batch_wait_s=0`` never waits. No step depends on
    how fast the machine is."""
    from skyrl_sdk.server.compute.executor import Executor
    from skyrl_sdk.server.compute.futures import Job, Result

    def Worker(name, batch_wait_s):  # one client's queue on an executor of its own
        return Executor(name, dedicated=True).queue(name, "alice", batch_wait_s=batch_wait_s)

    ran: list[tuple[list[str], float]] = []

    def job(name, key):
        def run_batch(jobs):
            ran.append(([j.payload for j in jobs], time.monotonic()))
            return [Result.json({})] * len(jobs)

        j = Job(run=lambda: run_batch([j])[0], done=lambda r: None, batch_key=key,
                run_batch=run_batch if key else None, payload=name)
        return j

    def settle(worker, n):
        deadline = time.monotonic() + HANG_S
        while sum(len(names) for names, _ in ran) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.close()

    # a wait far longer than the test: only another job can end it (whatever the machine's load)
    worker = Worker("w", batch_wait_s=HANG_S)
    for name in ("a1", "a2", "a3"):  # each within the wait of the one before
        worker.put(job(name, "a"))
        time.sleep(0.05)
    worker.put(job("b1", "b"))
    time.sleep(0.05)
    worker.put(job("c1", None))  # not batchable: b1 runs now, not when its wait ends
    settle(worker, 5)
    assert [names for names, _ in ran] == [["a1", "a2", "a3"], ["b1"], ["c1"]]  # no wait ran out

    ran.clear()
    worker = Worker("w", batch_wait_s=0.0)
    worker.put(job("a1", "a"))
    deadline = time.monotonic() + HANG_S
    while worker.jobs and time.monotonic() < deadline:  # taken: it is gathering its batch or running
        time.sleep(0.001)
    worker.put(job("a2", "a"))  # a waiting a1 would take it into its batch
    settle(worker, 2)
    assert [names for names, _ in ran] == [["a1"], ["a2"]]


@pytest.mark.slow
def test_cli_serve_env_api_key_and_ctrl_c(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from _server_harness import free_port

    port = free_port()
    env = {**os.environ, "SKYRL_SDK_API_KEY": "tml-from-env", "TINKER_TELEMETRY": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--port", str(port),
                             "--state-dir", str(tmp_path / "state")], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        assert httpx.post(f"{url}/api/v1/create_session", json={}).status_code == 401
        sc = tinker.ServiceClient(base_url=url, api_key="tml-from-env")
        tc = sc.create_lora_training_client(base_model="tiny", rank=2).result()
        tc.forward(to_tinker_list(make_sft_data([4], seed=1)), "cross_entropy").result()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_big_request_at_its_next_micro_batch_and_fails_the_queued_ones(tmp_path, sig):
    """A forward_backward of thousands of micro-batches runs and three more wait; one signal: the
    long-poll on the running one and the queued ones answer "shutting down", the process exits
    (a hang is caught, not a speed), and the state dir serves its checkpoints after a restart."""
    import os
    import signal
    import subprocess
    import sys

    from _server_harness import free_port, wait_result

    def serve():
        port = free_port()
        env = {**os.environ, "TINKER_TELEMETRY": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--port", str(port),
                                 "--state-dir", str(tmp_path / "state"), "--engine-config",
                                 '{"micro_batch_tokens": 16}'], env=env, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_S
        while True:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    return proc, httpx.Client(base_url=url, timeout=HANG_S)
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

    def fwdbwd(model_id, seq_id, rows):
        msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
        for _ in range(rows):
            d = msg.data.add()
            d.model_input.add().encoded_text.tokens = np.arange(1, 61, dtype=np.int32).tobytes()
            d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.arange(2, 62).tobytes(),
                                                                  dtype=pb.DTYPE_INT64, shape=[60]))
        return msg.SerializeToString()

    proc, http = serve()
    try:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        model_id = wait_result(http, fut["request_id"]).json()["model_id"]
        saved = http.post("/api/v1/save_weights", json={"model_id": model_id, "path": "before", "seq_id": 1}).json()
        assert wait_result(http, saved["request_id"]).json()["path"].endswith("/weights/before")
        proto = {"Content-Type": "application/x-protobuf"}
        big = http.post("/api/v1/forward_backward", content=fwdbwd(model_id, 2, 3000), headers=proto).json()
        queued = [http.post("/api/v1/forward_backward", content=fwdbwd(model_id, i, 1), headers=proto).json()
                  for i in (3, 4, 5)]
        answers: dict = {}
        poll = threading.Thread(target=lambda: answers.update(big=wait_result(http, big["request_id"]).json()))
        poll.start()
        time.sleep(1.0)  # (the big one has started; had it not, it fails as a queued one, which is checked too)
        proc.send_signal(getattr(signal, sig))
        poll.join(HANG_S)
        for q in queued:
            answers[q["request_id"]] = wait_result(http, q["request_id"]).json()
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    # after a clean shutdown uvicorn raises the signal again: SIGTERM's default action sets the status
    assert proc.returncode in ((0,) if sig == "SIGINT" else (0, -signal.SIGTERM)), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(answers) == 4
    for answer in answers.values():
        assert answer["category"] == "server" and "shutting down" in answer["error"], answer

    proc, http = serve()  # the state is as it was: the checkpoint saved before the signal is there
    try:
        listed = http.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in listed] == ["weights/before"]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=HANG_S)


def to_tinker_list(data):
    return [to_tinker(d) for d in data]


def test_checkpoint_directories_without_records_are_adopted_or_quarantined(tmp_path, caplog):
    """A save that died between writing its directory and recording it (or a state dir copied
    without its database) must not block the name: a complete checkpoint of a known run is
    adopted, anything else moved to quarantine, both logged; the names are free again."""
    import logging

    from skyrl_sdk.server.state.store import Store
    from skyrl_sdk.server.wire.tinker_paths import TinkerPath

    store = Store(tmp_path / "s")
    run = "sess-1:train:0"
    store.add_run(run, "default", "sess-1", "tiny", {"rank": 2}, None)
    backend = Backend("tiny", lora=types.LoraConfig(rank=2))
    recorded, done, half = (TinkerPath(run, "training", n) for n in ("recorded", "done", "half"))
    backend.save_state(store.checkpoint_dir(recorded))
    store.add_checkpoint(recorded)
    backend.save_state(store.checkpoint_dir(done))  # complete, never recorded
    store.checkpoint_dir(half).mkdir(parents=True)  # not a checkpoint of ours (no marker)
    (store.checkpoint_dir(half) / "model.safetensors").write_bytes(b"partial")
    stranger = store.root / "runs" / "run-of-no-record" / "sampler_weights" / "x"
    backend.save_weights_for_sampler(stranger)  # complete, but of no run this server knows
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk.server"):
        adopted, quarantined = store.reconcile_checkpoints()
    assert adopted == [str(done)]
    assert sorted(q.split("/")[1].split("-")[0] for q in quarantined) == ["half", "x"]  # short, hashed names
    assert "adopted 1 checkpoint" in caplog.text and "quarantine" in caplog.text
    for where in (f"runs/{store.run_dirname(run)}/weights/half", "runs/run-of-no-record/sampler_weights/x"):
        assert where in caplog.text  # the log says where each came from
    assert store.checkpoint(done, "default") is not None and store.resolve_checkpoint(str(done), "default")
    assert not store.checkpoint_dir(half).exists() and not stranger.exists()
    assert len(list((store.root / "quarantine").rglob(".skyrl_checkpoint"))) == 1
    backend.save_state(store.checkpoint_dir(half))  # the name is free again
    assert store.reconcile_checkpoints() == ([str(half)], [])  # and nothing else changes
    store.close()
