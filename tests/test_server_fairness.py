"""The compute executor: one thread for every client of a device, turns round-robin by owner
then client, small jobs between a big job's micro-batches, a stop that fails what has not run;
and on a real shared base, nested turns that leave every client's numbers exactly a solo
Backend's. Orders are checked, never durations (events hold jobs where a test needs them)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from skyrl_sdk import Backend, SharedBase
from skyrl_sdk.engines import turns
from skyrl_sdk.server.compute.executor import SHUTDOWN_MESSAGE, Executor
from skyrl_sdk.server.compute.futures import Job, Result
from skyrl_sdk.testing import make_sft_data, weights_of

HANG = 60  # seconds: only a hang takes this long


def _job(log: list, name: str, cost: int | None = 1, run=None, done=None) -> Job:
    def default_run():
        log.append(name)
        return Result.json({"name": name})

    return Job(run=run or default_run, done=done or (lambda r: None), what=name, cost=cost)


def _held(ex: Executor, log: list) -> threading.Event:
    """Occupy ``ex`` until the returned event is set (everything put meanwhile queues up)."""
    release, started = threading.Event(), threading.Event()

    def run():
        started.set()
        assert release.wait(HANG)
        return Result.json({})

    ex.queue("blocker", "zed").put(_job(log, "blocker", run=run))
    assert started.wait(HANG)
    return release


def _settle(log: list, n: int) -> None:
    deadline = time.monotonic() + HANG
    while len(log) < n:
        assert time.monotonic() < deadline, log
        time.sleep(0.005)


def test_turns_go_round_robin_by_owner_then_by_client():
    ex, log = Executor("t"), []
    a1, a2, b1 = ex.queue("a1", "alice"), ex.queue("a2", "alice"), ex.queue("b1", "bob")
    release = _held(ex, log)
    for q, names in ((a1, ["a1.1", "a1.2"]), (a2, ["a2.1"]), (b1, ["b1.1", "b1.2"])):
        for name in names:
            q.put(_job(log, name))
    release.set()
    _settle(log, 5)
    # alice and bob alternate; alice's turns alternate between her two clients
    assert log == ["a1.1", "b1.1", "a2.1", "b1.2", "a1.2"]
    ex.stop()


def test_small_jobs_of_other_clients_run_between_the_micro_batches_of_a_big_one():
    ex, log = Executor("t", turn_tokens=100), []
    a, b, c, d = (ex.queue(n, owner) for n, owner in (("a", "alice"), ("b", "bob"), ("c", "carol"), ("d", "dave")))

    def big():
        for i in range(4):
            log.append(f"a{i}")
            if i == 0:  # others' work arrives while the big job runs
                b.put(_job(log, "b1"))
                b.put(_job(log, "b2"))
                c.put(_job(log, "c1", cost=100))
                d.put(_job(log, "d1", cost=101))  # too big to run in between: waits for its own turn
                a.put(_job(log, "a-next"))  # the same client's next job never runs inside its own
            turns.between_micro_batches()
        return Result.json({})

    a.put(_job(log, "big", cost=10**6, run=big))
    _settle(log, 9)
    # one turn for each other small queue per micro-batch boundary, in turn order
    assert log[:7] == ["a0", "b1", "c1", "a1", "b2", "a2", "a3"]
    assert sorted(log[7:]) == ["a-next", "d1"]
    nested = {name for _, name, inner in ex.history if inner}
    assert nested == {"b", "c"}
    ex.stop()


def test_a_sample_batch_waits_for_more_only_while_nobody_else_has_work():
    ex, log = Executor("t"), []
    batches: list[list[str]] = []

    def run_batch(jobs):
        batches.append([j.payload for j in jobs])
        return [Result.json({})] * len(jobs)

    def sample(name):
        j = Job(run=lambda: run_batch([j])[0], done=lambda r: log.append(name), batch_key="k", run_batch=run_batch,
                payload=name, cost=1)
        return j

    sampler = ex.queue("s", "alice", batch_wait_s=HANG)  # would wait a minute per batch if it waited blindly
    other = ex.queue("o", "bob")
    release = _held(ex, log)
    sampler.put(sample("s1"))
    other.put(_job(log, "o1"))
    release.set()
    _settle(log, 2)  # s1 did not wait for company while bob had work (else a minute)
    assert batches == [["s1"]] and log == ["s1", "o1"]
    ex.stop()


def test_idle_for_is_per_queue():
    ex, log = Executor("t"), []
    waiting = ex.queue("w", "bob")
    release = _held(ex, log)
    waiting.put(_job(log, "w1"))
    time.sleep(0.05)
    assert waiting.idle_for() == 0.0  # queued behind another client: not idle (no gap skip, session busy)
    idle = ex.queue("i", "carol")
    assert idle.idle_for() > 0.0
    release.set()
    _settle(log, 1)
    ex.stop()


def test_stop_fails_queued_jobs_and_stops_the_running_one_at_its_next_micro_batch():
    ex, log = Executor("t"), []
    results: dict[str, Result] = {}
    started = threading.Event()

    def endless():
        started.set()
        for _ in range(10**6):
            time.sleep(0.001)
            turns.between_micro_batches()
        return Result.json({})

    q, other = ex.queue("q", "alice"), ex.queue("o", "bob")
    q.put(_job(log, "endless", run=endless, done=lambda r: results.__setitem__("endless", r)))
    assert started.wait(HANG)
    other.put(_job(log, "queued", done=lambda r: results.__setitem__("queued", r)))
    ex.stop()
    assert ex.join(HANG)
    for name in ("endless", "queued"):
        assert results[name].failed and SHUTDOWN_MESSAGE in results[name].body.decode()
    late: list[Result] = []
    q.put(_job(log, "late", done=late.append))  # after the stop: refused at once
    assert late and late[0].failed and "queued" not in log and "late" not in log


def test_a_job_may_close_its_own_queue_and_wait():
    ex, log = Executor("t"), []
    q = ex.queue("q", "alice")
    done: list[Result] = []

    def run():
        q.close(wait=True)  # on the executor's own thread: must not wait for itself
        return Result.json({})

    q.put(_job(log, "closer", run=run, done=done.append))
    _settle(done, 1)
    assert not done[0].failed
    ex.stop()


# ---- nested turns on a real shared base ------------------------------------------------------------
def test_turns_nested_between_micro_batches_leave_every_client_exactly_solo():
    """Client A's forward_backward gives way after its first micro-batch; there client B trains a
    step and the base answers a forward (adapters disabled). A's outputs, gradients and next step,
    and B's, equal solo Backends' bit for bit: each nested turn switches the active adapter (or
    disables them all) and hands A's back."""
    engine = {"micro_batch_tokens": 16}
    data_a, data_b = make_sft_data([7, 6, 7, 5], seed=1), make_sft_data([6, 4], seed=2)
    adam = {"learning_rate": 1e-2}
    with SharedBase("tiny", engine) as base:
        a, b = base.backend({"rank": 8, "seed": 3}), base.backend({"rank": 4, "seed": 4})
        reader = base.base_backend()
        inner: dict = {}

        def hook():
            if not inner:
                inner["b"] = b.forward_backward(data_b, "cross_entropy")
                inner["b_step"] = b.optim_step(adam)
                inner["base"] = reader.forward(data_b, "cross_entropy")

        with turns.on_micro_batch(hook):
            out_a = a.forward_backward(data_a, "cross_entropy")
        assert inner, "the call has more than one micro-batch, so the hook ran"
        a.optim_step(adam)
        shared = {"a": (out_a, weights_of(a)), "b": (inner["b"], weights_of(b))}
        base_out, base_alone = inner["base"], reader.forward(data_b, "cross_entropy")  # nested vs a turn alone

    solo_a = Backend("tiny", lora={"rank": 8, "seed": 3}, engine_config=engine)
    solo_b = Backend("tiny", lora={"rank": 4, "seed": 4}, engine_config=engine)
    want = {"a": (solo_a.forward_backward(data_a, "cross_entropy"), None),
            "b": (solo_b.forward_backward(data_b, "cross_entropy"), None)}
    solo_a.optim_step(adam)
    solo_b.optim_step(adam)
    for name, solo in (("a", solo_a), ("b", solo_b)):
        got_out, got_weights = shared[name]
        for g, w in zip(got_out.loss_fn_outputs, want[name][0].loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())
        solo_weights = weights_of(solo)
        assert got_weights.keys() == solo_weights.keys()
        assert all(torch.equal(got_weights[k], solo_weights[k]) for k in got_weights), name
    for g, w in zip(base_out.loss_fn_outputs, base_alone.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())


def test_a_nested_turn_never_offloads_the_adapter_it_interrupts(tmp_path):
    """With room for one adapter in memory, B's nested turn must not push A (mid-call) to disk."""
    data = make_sft_data([7, 6, 7], seed=1)
    with SharedBase("tiny", {"micro_batch_tokens": 16}, max_lora_adapters=1, offload_dir=tmp_path) as base:
        a, b = base.backend({"rank": 4, "seed": 1}), base.backend({"rank": 4, "seed": 2})
        ran: list[bool] = []

        def hook():
            if not ran:  # once (B's own micro-batches come here too)
                ran.append(None)
                b.forward(data, "cross_entropy")
                ran[0] = a.engine.adapter.offloaded is None and b.engine.adapter.offloaded is None

        with turns.on_micro_batch(hook):
            a.forward_backward(data, "cross_entropy")
        assert ran == [True]  # both in memory during the nested turn (one more than max_lora_adapters)
        assert a.engine.runner.has_pending_grads()


def test_no_hook_outside_an_executor():
    turns.between_micro_batches()  # a plain thread: nothing installed, nothing happens


# ---- through the server, with the tinker client ------------------------------------------------------
def _tinker(d):
    from tinker import types as tt

    return tt.Datum(model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(v.to_numpy()) for k, v in d.loss_fn_inputs.items()})


def test_another_owners_small_call_runs_inside_a_big_call_on_one_compute_thread(tmp_path, monkeypatch):
    """Alice's forward_backward of many micro-batches holds the base; Bob's 4-token forward, sent
    meanwhile, is answered between two of her micro-batches (before her call ends), and every
    client of the server computes on one thread. Alice's numbers equal a solo Backend's."""
    pytest.importorskip("tinker")
    pytest.importorskip("fastapi")
    from _server_harness import ServerThread
    from skyrl_sdk.engines import runner

    engine = {"micro_batch_tokens": 16}
    keys = {"tml-alice-0123456789": "alice", "tml-bob-0123456789ab": "bob"}
    reached, go = threading.Event(), threading.Event()
    real = runner.between_micro_batches

    threads = set()

    def held_once():  # Alice's call stops at its first boundary until Bob's request is queued
        threads.add(threading.current_thread())
        if not reached.is_set():
            reached.set()
            assert go.wait(HANG)
        real()

    big, small = make_sft_data([7] * 12, seed=5), make_sft_data([4], seed=6)
    with ServerThread(tmp_path / "state", api_key=None, api_keys=keys, engine_config=engine) as srv:
        clients = {}
        for key, owner in keys.items():
            sc = srv.service_client(api_key=key)
            clients[owner] = (sc, sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result())
        shared = srv.runtime.executors.shared
        assert srv.runtime.executors.all() == [shared]  # one executor, not one per client
        assert {m.worker.executor for m in srv.runtime.models.values()} == {shared}
        monkeypatch.setattr(runner, "between_micro_batches", held_once)
        alice, bob = clients["alice"][1], clients["bob"][1]
        fut_a = alice.forward_backward([_tinker(d) for d in big], "cross_entropy")
        assert reached.wait(HANG)
        fut_b = bob.forward([_tinker(d) for d in small], "cross_entropy")
        queue = srv.runtime.models[bob.model_id].worker
        deadline = time.monotonic() + HANG
        while queue.pending() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        go.set()
        fut_b.result(timeout=HANG)
        out_a = fut_a.result(timeout=HANG)
        history = list(shared.history)
        assert ("bob", bob.model_id, True) in history  # ran nested, inside Alice's call
        assert threads == {shared._thread}  # every micro-batch of both ran on the one compute thread
        for sc, _ in clients.values():
            sc.close("success").result()
    solo = Backend("tiny", lora={"rank": 4, "seed": 7}, engine_config=engine)
    want = solo.forward_backward(big, "cross_entropy")
    for g, w in zip(out_a.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())
