"""In-memory weight snapshots of ``save_weights_and_get_sampling_client`` sessions: nothing
written to disk, the pinned weights sampled exactly, the byte budget's LRU, bounded memory
(real server; the tinker client for LoRA, raw HTTP for full fine-tuning)."""

from __future__ import annotations

import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from _limits import HANG_S
from _server_harness import ServerThread, raw_client, wait_result
from skyrl_sdk import Backend, types
from skyrl_sdk.server.compute.memory import weight_bytes
from skyrl_sdk.testing import make_sft_data

RANK, SEED = 4, 7
PROMPT = [72, 101, 108, 108, 111]
PARAMS = tt.SamplingParams(max_tokens=6, seed=3, temperature=1.0)


def adapter_bytes() -> int:
    with Backend("tiny", lora=types.LoraConfig(rank=RANK, seed=SEED)) as b:
        return sum(p.numel() * p.element_size() for _, p in b.engine.runner.named_trainable())


def _tinker(d: types.Datum) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(v.to_numpy()) for k, v in d.loss_fn_inputs.items()})


def train_step(tc, step: int) -> None:
    tc.forward_backward([_tinker(d) for d in make_sft_data([8, 5], seed=step)], "cross_entropy").result()
    tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result()


def sample(client):
    return client.sample(tt.ModelInput.from_ints(PROMPT), 2, PARAMS).result(timeout=HANG_S)


def assert_same_samples(got, want):
    assert [list(s.tokens) for s in got.sequences] == [list(s.tokens) for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def scratch_files(srv) -> list:
    root = srv.config.state_dir / "scratch" / "snapshots"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def settled(check, timeout=HANG_S):
    """Samplers are closed by their own workers: wait for that to show."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


@pytest.mark.slow
def test_rl_loop_snapshots_in_memory_sample_old_weights_and_stay_bounded(tmp_path):
    """The cookbook's pattern for 20 steps: a sampling client per step, sample, train. Each
    step's old client, sampled after the weights changed, reproduces its own samples exactly."""
    with ServerThread(tmp_path / "state", share_base=True) as srv:
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
        runtime = srv.runtime
        prev, prev_result, counts = None, None, []
        for step in range(20):
            sampler = tc.save_weights_and_get_sampling_client().result()
            live = sample(sampler)
            if prev is not None:  # the previous version, now served from its in-memory snapshot
                assert_same_samples(sample(prev), prev_result)
                assert abs(live.sequences[0].logprobs[0] - prev_result.sequences[0].logprobs[0]) > 1e-6
            train_step(tc, step)
            prev, prev_result = sampler, live
            stats = runtime.sampling.snapshots.stats()
            counts.append((stats["count"], stats["bytes"]))
        assert scratch_files(srv) == []
        # bounded: the last max_ephemeral_snapshots adapters' tensors, samplers within their cache
        per = adapter_bytes()
        keep = srv.config.max_ephemeral_snapshots
        assert counts[-1] == (keep, keep * per)
        assert max(c for c, _ in counts) <= keep
        assert runtime.sampling.cached_samplers() <= srv.config.max_sampler_backends

        def adapters():
            return len(runtime.served.loaded()["bases"][0]["adapters"])

        # the training adapter plus at most max_sampler_backends snapshot samplers on the base
        assert settled(lambda: adapters() <= 1 + srv.config.max_sampler_backends), adapters()
        doc = raw_client(srv).get("/api/v1/loaded").json()
        assert doc["snapshots"]["count"] == keep and doc["snapshots"]["max_bytes"] == 2 * 1024**3
        sc.close("success").result()


def test_budget_evicts_least_recently_used_snapshot_with_a_clear_error(tmp_path):
    per = adapter_bytes()
    with ServerThread(tmp_path / "state", share_base=True, snapshot_memory=int(2.5 * per)) as srv:  # two snapshots fit
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
        clients, results = [], []
        for step in range(3):
            clients.append(tc.save_weights_and_get_sampling_client().result())
            results.append(sample(clients[-1]))
            if step == 2:  # touch snapshot 0: older than snapshot 1 by creation, newer by use
                assert_same_samples(sample(clients[0]), results[0])
            train_step(tc, step)
        # snapshot 2 did not fit beside 0 and 1: the least recently used (1) was evicted
        with pytest.raises(tinker.RequestFailedError, match=r"weights snapshot \(version 1 .*evicted from memory"
                                                            r".*--snapshot-memory.*create a new sampling client"):
            sample(clients[1])
        assert_same_samples(sample(clients[0]), results[0])
        assert_same_samples(sample(clients[2]), results[2])
        stats = srv.runtime.sampling.snapshots.stats()
        assert (stats["count"], stats["bytes"], stats["evictions"]) == (2, 2 * per, 1)
        assert scratch_files(srv) == []
        sc.close("success").result()


def test_snapshot_bigger_than_the_budget_is_written_to_disk(tmp_path):
    with ServerThread(tmp_path / "state", share_base=True, snapshot_memory=1024) as srv:
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        first = sample(sampler)
        train_step(tc, 0)
        assert_same_samples(sample(sampler), first)
        assert scratch_files(srv) != []
        assert srv.runtime.sampling.snapshots.stats()["count"] == 0
        sc.close("success").result()


# ---- full fine-tuning (raw HTTP: the tinker client creates LoRA models only) -------------------
def _fwdbwd(model_id: str, seq_id: int, data_seed: int) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for d in make_sft_data([8, 5], seed=data_seed):
        m = msg.data.add()
        m.model_input.add().encoded_text.tokens = np.asarray(d.model_input.to_ints(), np.int32).tobytes()
        for key, v in d.loss_fn_inputs.items():
            a = v.to_numpy()
            dtype = pb.DTYPE_INT64 if a.dtype.kind in "iu" else pb.DTYPE_FLOAT32
            m.loss_fn_inputs[key].CopyFrom(pb.Tensor(dense=a.astype(np.int64 if dtype == pb.DTYPE_INT64
                                                                     else np.float32).tobytes(),
                                                     dtype=dtype, shape=list(a.shape)))
    return msg.SerializeToString()


def _ok(http, answer):
    r = wait_result(http, answer["request_id"])
    assert r.headers["content-type"].startswith("application/x-protobuf") or "error" not in r.json(), r.text
    return r


def _raw_sample(http, sid: str, seq: int) -> pb.SampleResponse:
    r = _ok(http, http.post("/api/v1/asample", json={
        "sampling_session_id": sid, "seq_id": seq, "prompt": PROMPT,
        "num_samples": 2, "sampling_params": {"max_tokens": 6, "seed": 3, "temperature": 1.0}}).json())
    return pb.SampleResponse.FromString(r.content)


def _seqs(msg: pb.SampleResponse):
    return [(np.frombuffer(s.tokens, np.int32).tolist(), np.frombuffer(s.logprobs, np.float32)) for s in msg.sequences]


def test_full_fine_tuning_snapshot_is_the_full_weights_in_memory(tmp_path):
    with ServerThread(tmp_path / "state", share_base=True) as srv, raw_client(srv) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                       "base_model": "tiny"}).json()
        model_id = _ok(http, fut).json()["model_id"]

        def snapshot_session(seq: int, sampling_seq: int) -> str:
            return _ok(http, http.post("/api/v1/save_weights_for_sampler", json={
                "model_id": model_id, "seq_id": seq, "sampling_session_seq_id": sampling_seq}).json()
            ).json()["sampling_session_id"]

        def step(seq: int, data_seed: int) -> None:
            _ok(http, http.post("/api/v1/forward_backward", content=_fwdbwd(model_id, seq, data_seed),
                                headers={"Content-Type": "application/x-protobuf"}).json())
            _ok(http, http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq + 1,
                                                            "adam_params": {"learning_rate": 5e-2}}).json())

        step(1, 0)  # pin a trained version (a fresh sampler copy would not equal it by chance)
        pinned = snapshot_session(3, 0)
        before = _seqs(_raw_sample(http, pinned, 1))
        with Backend("tiny") as solo:  # the same weights, trained and sampled in process
            solo.forward_backward(make_sft_data([8, 5], seed=0), "cross_entropy")
            solo.optim_step(types.AdamParams(learning_rate=5e-2))
            want = solo.sample([PROMPT], {"max_tokens": 6, "seed": 3, "temperature": 1.0}, 2)[0]
        assert [t for t, _ in before] == [list(s.tokens) for s in want.sequences]
        for (_, lp), s in zip(before, want.sequences, strict=True):
            np.testing.assert_allclose(lp, s.logprobs, atol=1e-5)
        step(4, 1)
        after_step = _seqs(_raw_sample(http, pinned, 2))  # from the in-memory snapshot
        assert [t for t, _ in after_step] == [t for t, _ in before]
        for (_, a), (_, b) in zip(after_step, before, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        live = _seqs(_raw_sample(http, snapshot_session(6, 1), 0))
        assert abs(live[0][1][0] - before[0][1][0]) > 1e-6  # the trained weights differ
        stats = srv.runtime.sampling.snapshots.stats()
        assert (stats["count"], stats["bytes"]) == (1, weight_bytes("tiny", 4))
        assert scratch_files(srv) == []


def test_snapshot_memory_flag():
    from skyrl_sdk.cli.commands import build_parser
    from skyrl_sdk.errors import InputError
    from skyrl_sdk.server import settings
    from skyrl_sdk.server.config import ServerConfig

    parse = build_parser().parse_args
    assert ServerConfig.from_args(parse(["serve", "--snapshot-memory", "64MiB"])).snapshot_memory == 64 * 2**20
    assert ServerConfig.from_args(parse(["serve"])).snapshot_memory == settings.default("snapshot_memory") == 2 * 2**30
    for bad in ("lots", "0", "-1GiB"):
        with pytest.raises(InputError, match="--snapshot-memory"):
            ServerConfig.from_args(parse(["serve", f"--snapshot-memory={bad}"]))


def test_unshared_lora_snapshot_loads_into_a_sampler_copy(tmp_path):
    """share_base=False: the adapter's tensors go into an own LoRA copy (same names, no disk)."""
    with ServerThread(tmp_path / "state", share_base=False) as srv:
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
        train_step(tc, 0)  # pin a trained version (a fresh adapter would not equal it by chance)
        sampler = tc.save_weights_and_get_sampling_client().result()
        first = sample(sampler)
        train_step(tc, 1)
        assert_same_samples(sample(sampler), first)
        assert srv.runtime.sampling.snapshots.stats()["bytes"] == adapter_bytes()
        assert scratch_files(srv) == []
        sc.close("success").result()
