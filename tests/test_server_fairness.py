"""The compute executor: one thread for every client of a device, turns round-robin by owner
then client, small jobs between a big job's micro-batches (each on a stack of its own, the big
one paused), a stop that fails what has not run; and on a real shared base, calls paused between
micro-batches while others run, leaving every client's numbers exactly a solo Backend's. Orders
are checked, never durations (events hold jobs where a test needs them)."""

from __future__ import annotations

import inspect
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
    """The big job is a stepped call: it yields at each micro-batch boundary and the executor,
    from its own loop, gives each other queue with a small job one turn, then resumes it. A job
    run in the gap has a stack of its own: the big call's frames are not on it (before: it ran
    inside the big call's micro-batch loop)."""
    ex, log = Executor("t", turn_tokens=100), []
    a, b, c, d = (ex.queue(n, owner) for n, owner in (("a", "alice"), ("b", "bob"), ("c", "carol"), ("d", "dave")))
    inside_big: list[bool] = []

    def small(name, cost=1):
        def run():
            inside_big.append(any(f.function == "big" for f in inspect.stack()))
            log.append(name)
            return Result.json({"name": name})
        return _job(log, name, cost=cost, run=run)

    def big():
        for i in range(4):
            log.append(f"a{i}")
            if i == 0:  # others' work arrives while the big job runs
                b.put(small("b1"))
                b.put(small("b2"))
                c.put(small("c1", cost=100))
                d.put(small("d1", cost=101))  # too big to run in between: waits for its own turn
                a.put(small("a-next"))  # the same client's next job never runs inside its own
            if i < 3:
                yield  # a micro-batch boundary
        return Result.json({})

    a.put(_job(log, "big", cost=10**6, run=big))
    _settle(log, 9)
    # one turn for each other small queue per micro-batch boundary, in turn order
    assert log[:7] == ["a0", "b1", "c1", "a1", "b2", "a2", "a3"]
    assert sorted(log[7:]) == ["a-next", "d1"]
    in_gaps = {name for _, name, in_gap in ex.history if in_gap}
    assert in_gaps == {"b", "c"}
    assert inside_big == [False] * 5  # every small job ran on its own stack, none inside the big call
    ex.stop()


def test_a_job_in_a_gap_runs_to_its_end_and_a_failing_step_fails_only_its_job():
    """A stepped job run in another's gap does not give way again (its boundaries pass without
    turns); a step that raises fails its own job with the error, and the executor goes on."""
    ex, log = Executor("t", turn_tokens=100), []
    a, b, c = ex.queue("a", "alice"), ex.queue("b", "bob"), ex.queue("c", "carol")
    results: dict[str, Result] = {}

    def stepped(name, steps, fail_at=None):
        def run():
            for i in range(steps):
                log.append(f"{name}{i}")
                if i == fail_at:
                    raise RuntimeError(f"{name} broke")
                if i + 1 < steps:
                    yield
            return Result.json({})
        return _job(log, name, cost=1 if name != "a" else 10**6, run=run,
                    done=lambda r: results.__setitem__(name, r))

    release = _held(ex, log)
    a.put(stepped("a", 3, fail_at=1))
    b.put(stepped("b", 3))
    c.put(stepped("c", 2))
    release.set()
    _settle(log, 7)
    assert log == ["a0", "b0", "b1", "b2", "c0", "c1", "a1"]  # a's gap: b then c, each whole
    assert results["a"].failed and "a broke" in results["a"].body.decode()
    assert not results["b"].failed and not results["c"].failed
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

    cleaned: list[bool] = []

    def endless():
        started.set()
        try:
            for _ in range(10**6):
                time.sleep(0.001)
                yield
        finally:
            cleaned.append(True)  # the stop is thrown in at the boundary: the call cleans up
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
    assert cleaned == [True]


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


# ---- calls paused between micro-batches on a real shared base -------------------------------------
def test_calls_run_while_another_is_paused_leave_every_client_exactly_solo():
    """Client A's forward_backward pauses after its first micro-batch (a stepped call, driven by
    hand as the executor does); meanwhile client B trains a step and the base answers a forward
    (adapters disabled). A's outputs, gradients and next step, and B's, equal solo Backends' bit
    for bit: each of A's steps takes its own turn and makes its adapter active again."""
    engine = {"micro_batch_tokens": 16}
    data_a, data_b = make_sft_data([7, 6, 7, 5], seed=1), make_sft_data([6, 4], seed=2)
    adam = {"learning_rate": 1e-2}
    with SharedBase("tiny", engine) as base:
        a, b = base.backend({"rank": 8, "seed": 3}), base.backend({"rank": 4, "seed": 4})
        reader = base.base_backend()
        call = a.forward_backward_steps(data_a, "cross_entropy")
        next(call)  # A's first micro-batch; A is paused at its first boundary
        assert base.shared.gate.holder is None  # a paused call holds no turn
        inner = {"b": b.forward_backward(data_b, "cross_entropy"), "b_step": b.optim_step(adam),
                 "base": reader.forward(data_b, "cross_entropy")}
        out_a = turns.run_to_end(call)
        a.optim_step(adam)
        shared = {"a": (out_a, weights_of(a)), "b": (inner["b"], weights_of(b))}
        base_out, base_alone = inner["base"], reader.forward(data_b, "cross_entropy")  # in A's gap vs alone

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


def test_a_paused_call_keeps_its_adapter_in_memory(tmp_path):
    """With room for one adapter in memory, B's turn while A's call is paused must not push A
    (mid-call: its gradients held apart) to disk."""
    data = make_sft_data([7, 6, 7], seed=1)
    with SharedBase("tiny", {"micro_batch_tokens": 16}, max_lora_adapters=1, offload_dir=tmp_path) as base:
        a, b = base.backend({"rank": 4, "seed": 1}), base.backend({"rank": 4, "seed": 2})
        call = a.forward_backward_steps(data, "cross_entropy")
        next(call)
        b.forward(data, "cross_entropy")
        assert a.engine.adapter.offloaded is None and b.engine.adapter.offloaded is None  # one over the cap
        turns.run_to_end(call)
        assert a.engine.runner.has_pending_grads()
        base.backend({"rank": 4, "seed": 3})  # a new adapter: the others go to disk, A too now its call ended
        assert a.engine.adapter.offloaded is not None and b.engine.adapter.offloaded is not None


def test_turns_never_nest():
    """A turn asked for by the thread that holds one is refused, not granted again (before: the
    gate re-entered, which is how a client's call ran inside another's)."""
    gate = turns.FairGate()
    with gate.turn("a"):
        with pytest.raises(RuntimeError, match="turns never nest"):
            with gate.turn("b"):
                pass
    with gate.turn("b"):  # the refusal left the gate as it was
        pass
    assert list(gate.history) == ["a", "b"]


# ---- through the server, with the tinker client ------------------------------------------------------
def _tinker(d):
    from tinker import types as tt

    return tt.Datum(model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(v.to_numpy()) for k, v in d.loss_fn_inputs.items()})


def _micro_batch_loops_on_the_stack() -> int:
    """How many calls' micro-batch loops (``ModelRunner.run`` / ``steps``) the stack holds."""
    from skyrl_sdk.engines import runner

    return sum(f.filename == runner.__file__ and f.function in ("run", "steps") for f in inspect.stack(0))


def test_another_owners_small_call_runs_between_a_big_calls_micro_batches_on_one_thread(tmp_path):
    """Alice's forward_backward of many micro-batches holds the device; Bob's 4-token forward, sent
    meanwhile, is answered between two of her micro-batches (before her call ends), on its own
    stack: every micro-batch of both runs with exactly one call's loop on the stack (before: Bob's
    ran inside Alice's), and every client of the server computes on one thread. Alice's numbers
    equal a solo Backend's."""
    pytest.importorskip("tinker")
    pytest.importorskip("fastapi")
    from _server_harness import ServerThread
    from skyrl_sdk.testing import around_micro_batches

    engine = {"micro_batch_tokens": 16}
    keys = {"tml-alice-0123456789": "alice", "tml-bob-0123456789ab": "bob"}
    reached, go = threading.Event(), threading.Event()
    threads, loops = set(), []

    def held_once(compute):  # Alice's call stops after its first micro-batch until Bob's is queued
        threads.add(threading.current_thread())
        loops.append(_micro_batch_loops_on_the_stack())
        out = compute()
        if not reached.is_set():
            reached.set()
            assert go.wait(HANG)
        return out

    big, small = make_sft_data([7] * 12, seed=5), make_sft_data([4], seed=6)
    with ServerThread(tmp_path / "state", api_key=None, api_keys=keys, engine_config=engine) as srv:
        clients = {}
        for key, owner in keys.items():
            sc = srv.service_client(api_key=key)
            clients[owner] = (sc, sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result())
        shared = srv.runtime.executors.shared
        assert srv.runtime.executors.all() == [shared]  # one executor, not one per client
        assert {m.worker.executor for m in srv.runtime.models.values()} == {shared}
        with around_micro_batches(held_once):
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
            assert ("bob", bob.model_id, True) in history  # ran in a gap of Alice's call
            assert threads == {shared.thread}  # every micro-batch of both ran on the one compute thread
            assert len(loops) >= 3 and set(loops) == {1}  # ... each with one call's loop on the stack
        for sc, _ in clients.values():
            sc.close("success").result()
    solo = Backend("tiny", lora={"rank": 4, "seed": 7}, engine_config=engine)
    want = solo.forward_backward(big, "cross_entropy")
    for g, w in zip(out_a.loss_fn_outputs, want.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())
