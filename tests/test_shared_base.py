"""SharedBase: LoRA adapters on one copy of the base, each equal to a solo Backend."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _limits import HANG_S
from skyrl_sdk import Backend, SharedBase
from skyrl_sdk.engines.throughput import without_throughput
from skyrl_sdk.engines.turns import FairGate, RoundRobin
from skyrl_sdk.errors import CheckpointError, InputError
from skyrl_sdk.models.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, load_tensors
from skyrl_sdk.testing import grads_of, make_sft_data, weights_of

ADAM = {"learning_rate": 1e-2}
LORA_A = {"rank": 8}
LORA_B = {"rank": 4, "train_mlp": False, "seed": 3}


def _exact(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _outputs(out) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _files_equal(a: Path, b: Path) -> None:
    for name in (WEIGHTS_FILE, OPTIMIZER_FILE):
        _exact(load_tensors(a / name), load_tensors(b / name), name)
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def data():
    return [make_sft_data([7, 5], seed=s) for s in range(4)]


def _train(backend, data, steps):
    """forward_backward on two batches, then a step (gradients of the two add up)."""
    outs = []
    for i in range(steps):
        outs.append(backend.forward_backward(data[(2 * i) % 4], "cross_entropy"))
        outs.append(backend.forward_backward(data[(2 * i + 1) % 4], "cross_entropy"))
        backend.optim_step(ADAM)
    return outs


def test_base_is_shared_not_copied():
    with SharedBase("tiny") as base:
        a, b = base.backend(LORA_A), base.backend(LORA_B)
        module_a, module_b = a.engine.shared.module, b.engine.shared.module
        assert module_a is module_b
        embed = module_a.get_input_embeddings().weight
        assert embed.data_ptr() == b.engine.shared.module.get_input_embeddings().weight.data_ptr()
        stats = base.stats()
        assert [r["rank"] for r in stats["adapters"]] == [8, 4]
        assert all(0 < r["bytes"] < 0.15 * stats["base_bytes"] for r in stats["adapters"])
        a.close()
        assert [r["rank"] for r in base.stats()["adapters"]] == [4]
        assert b.get_info().num_trainable_parameters == sum(w.numel() for w in weights_of(b).values())


def test_stats_read_tensors_only_in_the_adapters_turn(data, monkeypatch):
    """stats() is asked from any thread (the server's memory check, its logs) while another
    thread runs a backward that replaces ``p.grad`` in C++ without the GIL; reading the
    tensors then corrupted the heap (glibc abort, 3 server test runs in 8). Every read of an
    adapter's tensors must come from the thread that holds the base's turn; the byte counts
    still follow the gradients and AdamW state."""
    from skyrl_sdk.engines import offload
    from skyrl_sdk.engines import pool as shared

    readers: list[bool] = []
    real = offload.adapter_bytes

    def spy(runner):
        gate = base.shared.gate
        readers.append(gate.holder == threading.get_ident())
        return real(runner)

    monkeypatch.setattr(offload, "adapter_bytes", spy)
    assert shared.offload is offload
    with SharedBase("tiny") as base, base.backend(LORA_A) as a:
        trainable = a.engine.runner.named_trainable()
        params = sum(p.numel() * 4 for _, p in trainable)
        assert base.stats()["adapters"][0]["bytes"] == params
        a.forward_backward(data[0], "cross_entropy")
        assert base.stats()["adapters"][0]["bytes"] == 2 * params  # weights + gradients
        a.optim_step(ADAM)
        # weights, AdamW's two moments and its step counter (a float32 scalar per tensor)
        assert base.stats()["adapters"][0]["bytes"] == 3 * params + 4 * len(trainable)
    assert readers and all(readers)


def test_set_adapter_runs_only_when_the_active_adapter_changes(data, monkeypatch):
    """peft's set_adapter walks every adapter layer (7 ms on the GRPO benchmark's model, five
    times per RL step through the server): turns of the adapter already active skip it; another
    adapter's turn (or an added one) makes the next turn set it again; the base's turn (adapters
    disabled, then re-enabled) leaves it active."""
    with SharedBase("tiny") as base, base.backend(LORA_A) as a:
        shared = base.shared
        calls: list[str] = []
        real = shared.module.set_adapter
        monkeypatch.setattr(shared.module, "set_adapter", lambda name: (calls.append(name), real(name))[1])
        a.forward_backward(data[0], "cross_entropy")
        a.optim_step(ADAM)
        a.forward(data[1], "cross_entropy")
        assert len(calls) <= 1
        calls.clear()
        with base.backend(LORA_B) as b:
            b.forward_backward(data[0], "cross_entropy")
            a.forward_backward(data[0], "cross_entropy")
            a.optim_step(ADAM)
            assert calls == [b.engine.adapter.name, a.engine.adapter.name]
            assert all(p.requires_grad for _, p in a.engine.runner.named_trainable())
            assert not any(p.requires_grad for _, p in b.engine.runner.named_trainable())
            with shared.using(None):
                pass
            a.forward(data[1], "cross_entropy")
            assert calls == [b.engine.adapter.name, a.engine.adapter.name]
            assert all(p.requires_grad for _, p in a.engine.runner.named_trainable())


def test_interleaved_adapters_equal_solo_backends(data, tmp_path):
    solo_a, solo_b = Backend("tiny", lora=LORA_A), Backend("tiny", lora=LORA_B)
    with SharedBase("tiny") as base:
        a, b = base.backend(LORA_A), base.backend(LORA_B)
        _exact(weights_of(a), weights_of(solo_a), "initial A")
        _exact(weights_of(b), weights_of(solo_b), "initial B")
        # interleave: A's gradients are pending while B runs and steps
        out_a1 = a.forward_backward(data[0], "cross_entropy")
        out_b1 = b.forward_backward(data[1], "cross_entropy")
        b.optim_step(ADAM)
        out_a2 = a.forward_backward(data[2], "cross_entropy")
        grads_a = grads_of(a)
        a.optim_step(ADAM)
        out_b2 = b.forward_backward(data[3], "cross_entropy")
        b.optim_step(ADAM)

        ref_a1 = solo_a.forward_backward(data[0], "cross_entropy")
        ref_a2 = solo_a.forward_backward(data[2], "cross_entropy")
        _exact(grads_a, grads_of(solo_a), "A gradients")
        solo_a.optim_step(ADAM)
        ref_b1 = solo_b.forward_backward(data[1], "cross_entropy")
        solo_b.optim_step(ADAM)
        ref_b2 = solo_b.forward_backward(data[3], "cross_entropy")
        solo_b.optim_step(ADAM)
        for got, ref in ((out_a1, ref_a1), (out_a2, ref_a2), (out_b1, ref_b1), (out_b2, ref_b2)):
            for x, y in zip(_outputs(got), _outputs(ref), strict=True):
                np.testing.assert_array_equal(x, y)
            assert without_throughput(got.metrics) == without_throughput(ref.metrics)
        _exact(weights_of(a), weights_of(solo_a), "A weights")
        _exact(weights_of(b), weights_of(solo_b), "B weights")

        # checkpoints: the same files as the solo Backends'
        for name, shared, solo in (("a", a, solo_a), ("b", b, solo_b)):
            shared.save_state(tmp_path / f"{name}-shared")
            solo.save_state(tmp_path / f"{name}-solo")
            _files_equal(tmp_path / f"{name}-shared", tmp_path / f"{name}-solo")
        # merged export and adapter-only export equal the solo ones
        a.save_weights_for_sampler(tmp_path / "exp-shared")
        solo_a.save_weights_for_sampler(tmp_path / "exp-solo")
        _exact(load_tensors(tmp_path / "exp-shared" / WEIGHTS_FILE), load_tensors(tmp_path / "exp-solo" / WEIGHTS_FILE),
               "merged export")
        b.save_weights_for_sampler(tmp_path / "ad-shared", merge_lora=False)
        solo_b.save_weights_for_sampler(tmp_path / "ad-solo", merge_lora=False)
        names = sorted(p.name for p in (tmp_path / "ad-solo").iterdir())
        assert sorted(p.name for p in (tmp_path / "ad-shared").iterdir()) == names
        for n in ("adapter_model.safetensors", "adapter_config.json"):
            assert (tmp_path / "ad-shared" / n).read_bytes() == (tmp_path / "ad-solo" / n).read_bytes(), n

        # a solo checkpoint loads into a shared adapter (and continues identically)
        c = base.backend(LORA_A)
        c.load_state(tmp_path / "a-solo")
        _exact(weights_of(c), weights_of(solo_a), "loaded")
        c.forward_backward(data[1], "cross_entropy")
        solo_a.forward_backward(data[1], "cross_entropy")
        c.optim_step(ADAM)
        solo_a.optim_step(ADAM)
        _exact(weights_of(c), weights_of(solo_a), "after a step from the loaded state")
    solo_a.close()
    solo_b.close()


def test_state_of_another_base_is_refused(tmp_path, data):
    with Backend("tiny", lora=LORA_A, seed=9) as other:  # 'tiny' with another seed: another base
        other.save_state(tmp_path / "other")
    with SharedBase("tiny") as base:
        a = base.backend(LORA_A)
        before = weights_of(a)
        with pytest.raises(CheckpointError, match="another base"):
            a.load_state(tmp_path / "other")
        _exact(weights_of(a), before, "unchanged")


def test_offload_and_reload_are_exact(data, tmp_path):
    # the LoRA seed differs; the base (tiny: from the Backend seed) is the same
    solos = [Backend("tiny", lora={"rank": 8, "seed": s}) for s in range(3)]
    with SharedBase("tiny", max_lora_adapters=1, offload_dir=tmp_path / "off") as base:
        clients = [base.backend({"rank": 8}, seed=s) for s in range(3)]
        assert base.stats()["adapters_in_memory"] == 1
        for round_ in range(2):
            for client, solo in zip(clients, solos, strict=True):
                # leave gradients pending across the switch: they are offloaded too
                client.forward_backward(data[round_], "cross_entropy")
                solo.forward_backward(data[round_], "cross_entropy")
            for client, solo in zip(clients, solos, strict=True):
                client.forward_backward(data[round_ + 2], "cross_entropy")
                solo.forward_backward(data[round_ + 2], "cross_entropy")
                client.optim_step(ADAM)
                solo.optim_step(ADAM)
        stats = base.stats()
        assert stats["offloads"] >= 10 and stats["reloads"] >= 10
        assert stats["adapters_in_memory"] == 1
        assert sum(r["offloaded"] for r in stats["adapters"]) == 2
        assert len(list((tmp_path / "off").glob("*.safetensors"))) == 2
        for client, solo in zip(clients, solos, strict=True):
            client.save_state(tmp_path / f"c{id(client)}")  # brings the client back into memory
            _exact(weights_of(client), weights_of(solo), "weights after offload round trips")
            solo.save_state(tmp_path / f"s{id(client)}")
            _files_equal(tmp_path / f"c{id(client)}", tmp_path / f"s{id(client)}")
        clients[0].close()
        assert len(list((tmp_path / "off").glob("*.safetensors"))) <= 2
    for s in solos:
        s.close()


def test_closing_the_active_adapter_warns_nothing_and_the_others_stay_exact(data):
    """Closing the client whose adapter peft has active switches to another first (peft would
    warn "Adapter ... was active which is now deleted" once per layer); the remaining clients'
    results are unchanged, offloaded ones included."""
    import warnings

    with SharedBase("tiny", max_lora_adapters=2) as base:
        clients = [base.backend({"rank": 4}, seed=s) for s in range(3)]  # one offloaded at a time
        before = [_outputs(c.forward(data[0], "cross_entropy")) for c in clients]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for closing in (2, 0):
                clients[closing].forward(data[1], "cross_entropy")  # its adapter is the active one
                clients[closing].close()
            after = _outputs(clients[1].forward(data[0], "cross_entropy"))
            clients[1].close()  # the last one
    for got, expected in zip(after, before[1], strict=True):
        np.testing.assert_array_equal(got, expected)


def test_base_backend_is_read_only_and_equals_the_base(data):
    with SharedBase("tiny") as base, Backend("tiny") as plain:
        a = base.backend(LORA_A)
        a.forward_backward(data[0], "cross_entropy")
        a.optim_step(ADAM)  # the adapter is non-zero now; the base must not see it
        reader = base.base_backend()
        got = reader.forward(data[1], "cross_entropy")
        ref = plain.forward(data[1], "cross_entropy")
        for x, y in zip(_outputs(got), _outputs(ref), strict=True):
            np.testing.assert_array_equal(x, y)
        params = {"max_tokens": 5, "seed": 4, "temperature": 1.0}
        assert reader.sample([[1, 2, 3]], params)[0].sequences[0].tokens == \
            plain.sample([[1, 2, 3]], params)[0].sequences[0].tokens
        with pytest.raises(InputError, match="read-only"):
            reader.forward_backward(data[0], "cross_entropy")
        with pytest.raises(InputError, match="read-only"):
            reader.optim_step(ADAM)
        with pytest.raises(InputError, match="LoRA adapters only"):
            base.backend(None)


def test_base_backend_takes_the_engine_keywords_of_the_others(data):
    """keep_grads_on_error reaches the read-only engine's run_steps as it does every engine's (it
    raised TypeError there, both through LocalEngine.run and a forward_backward that sets it)."""
    with SharedBase("tiny") as base, Backend("tiny") as plain:
        reader = base.base_backend()
        for keep in (True, False):
            with pytest.raises(InputError, match="read-only"):
                reader.forward_backward(data[0], "cross_entropy", keep_grads_on_error=keep)
        loss = reader.resolve("cross_entropy")
        got = reader.engine.run(list(data[1]), loss, backward=False)
        ref = plain.engine.run(list(data[1]), plain.resolve("cross_entropy"), backward=False)
        for x, y in zip(got.outputs, ref.outputs, strict=True):
            np.testing.assert_array_equal(x["logprobs"], y["logprobs"])


def test_round_robin_order_is_fair_and_keeps_each_clients_order():
    rr = RoundRobin()
    for key, tickets in (("a", 4), ("b", 1), ("c", 2)):
        for i in range(tickets):
            rr.add(key, f"{key}{i}")
    order = [rr.next()[1] for _ in range(7)]
    assert order == ["a0", "b0", "c0", "a1", "c1", "a2", "a3"]
    assert rr.next() is None


def test_round_robin_rotates_owners_then_their_queues_as_the_server_executor_serves_them():
    """The same RoundRobin, members kept (a queue with more work) instead of consumed: owners
    take turns, then each owner's queues; a member the caller skips keeps its place."""
    rr = RoundRobin()
    for owner, queue in (("alice", "a1"), ("alice", "a2"), ("bob", "b1"), ("carol", "c1")):
        rr.add(owner, queue)
    order = [rr.pick()[1] for _ in range(6)]
    assert order == ["a1", "b1", "c1", "a2", "b1", "c1"]
    assert rr.pick(accept=lambda q: q != "a1") == ("alice", "a2")  # alice's turn; a1 is skipped, keeps its place
    rr.discard("carol", "c1")
    assert rr.members() == ["b1", "a1", "a2"] and rr.waiting() == 3
    assert rr.pick(accept=lambda q: q.startswith("a")) == ("alice", "a1")
    assert rr.pick(accept=lambda q: False) is None


def test_fair_gate_threads_follow_the_round_robin_order():
    gate = FairGate()
    release = {k: threading.Event() for k in ("a1", "a2", "a3", "b1", "c1")}

    def client(name: str) -> None:
        with gate.turn(name[0]):
            release[name].wait(HANG_S)

    with gate.turn("holder"):
        threads = []
        for name in ("a1", "a2", "a3", "b1", "c1"):
            before = gate.waiting()
            threads.append(threading.Thread(target=client, args=(name,)))
            threads[-1].start()
            while gate.waiting() == before:  # wait until it queued: arrival order is then known
                time.sleep(0.001)
    for ev in release.values():
        ev.set()
    for t in threads:
        t.join(HANG_S)
    assert list(gate.history) == ["holder", "a", "b", "c", "a", "a"]
