"""One call at a time on a Backend (``engines/call_slot.py``): while a stepped call is paused at a
micro-batch boundary, every other call on the same Backend is refused, from any thread, naming the
paused call, and the paused call then ends exactly as it would have undisturbed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import skyrl_sdk
from _limits import HANG_S
from skyrl_sdk import types
from skyrl_sdk.engines import turns
from skyrl_sdk.engines.call_slot import CallSlot
from skyrl_sdk.errors import CallInProgressError, InputError
from skyrl_sdk.testing import make_sft_data, weights_of

ENGINE = {"micro_batch_tokens": 16}
ADAM = types.AdamParams(learning_rate=1e-2)


def _data():
    return make_sft_data([7, 6, 7, 5], seed=1)  # four micro-batches of 16 tokens: three boundaries


def _loss(out: types.ForwardBackwardOutput) -> float:
    return float(out.metrics["loss:sum"])


def _undisturbed() -> tuple[float, dict[str, torch.Tensor]]:
    with skyrl_sdk.Backend("tiny", engine_config=ENGINE) as b:
        out = b.forward_backward(_data(), "cross_entropy")
        b.optim_step(ADAM)
        return _loss(out), weights_of(b)


def _every_other_call(b: skyrl_sdk.Backend, tmp_path) -> dict:
    """Each public call that computes or changes state, as a thunk."""
    return {
        "optim_step": lambda: b.optim_step(ADAM),
        "forward_backward": lambda: b.forward_backward(_data(), "cross_entropy"),
        "forward_backward_steps": lambda: next(b.forward_backward_steps(_data(), "cross_entropy")),
        "forward": lambda: b.forward(_data(), "cross_entropy"),
        "zero_grad": b.zero_grad,
        "sample": lambda: b.sample([[1, 2]], types.SamplingParams(max_tokens=1)),
        "save_state": lambda: b.save_state(tmp_path / "state"),
        "save_weights_for_sampler": lambda: b.save_weights_for_sampler(tmp_path / "export"),
        "load_state": lambda: b.load_state(tmp_path / "missing"),
        "weights_changed": b.weights_changed,
        "close": b.close,
    }


def test_a_paused_forward_backward_refuses_every_other_call_and_ends_as_if_undisturbed(tmp_path):
    want_loss, want_weights = _undisturbed()
    with skyrl_sdk.Backend("tiny", engine_config=ENGINE) as b:
        version = b.weights_version
        call = b.forward_backward_steps(_data(), "cross_entropy")
        next(call)  # paused at its first micro-batch boundary
        for name, other in _every_other_call(b, tmp_path).items():
            with pytest.raises(CallInProgressError, match=r"refused .* its call forward_backward is paused") as e:
                other()
            assert isinstance(e.value, InputError), name  # a usage error: the server answers it as the caller's
        assert b.pending_calls == 0 and b.weights_version == version and not b.closed
        assert not (tmp_path / "state").exists() and not (tmp_path / "export").exists()
        got = turns.run_to_end(call)
        assert b.pending_calls == 1
        b.optim_step(ADAM)  # the slot is free again
        assert _loss(got) == want_loss
        got_weights = weights_of(b)
    assert all(torch.equal(got_weights[k], want_weights[k]) for k in want_weights)


def test_other_threads_are_refused_too_not_kept_waiting():
    with skyrl_sdk.Backend("tiny", engine_config=ENGINE) as b:
        call = b.forward_backward_steps(_data(), "cross_entropy")
        next(call)
        errors: list[BaseException] = []

        def step() -> None:
            try:
                b.optim_step(ADAM)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=step)
        worker.start()
        worker.join(HANG_S)
        assert not worker.is_alive(), "optim_step on another thread waited for the paused call"
        assert len(errors) == 1 and isinstance(errors[0], CallInProgressError)
        assert f"on thread {threading.get_ident()}" in str(errors[0])
        turns.run_to_end(call)
        b.optim_step(ADAM)


def test_a_closed_stepped_call_frees_the_slot_and_counts_no_call():
    with skyrl_sdk.Backend("tiny", engine_config=ENGINE) as b:
        call = b.forward_backward_steps(_data(), "cross_entropy")
        next(call)
        call.close()  # its driver gave up: it cleans up, its gradients dropped
        assert b.pending_calls == 0
        out = b.forward(_data(), "cross_entropy")  # the slot is free
        assert np.isfinite(_loss(out))


def test_a_refused_first_step_leaves_the_refused_call_unstarted():
    with skyrl_sdk.Backend("tiny", engine_config=ENGINE) as b:
        first = b.forward_steps(_data(), "cross_entropy")
        next(first)
        second = b.forward_backward_steps(_data(), "cross_entropy")
        with pytest.raises(CallInProgressError, match="forward_backward refused .* its call forward is paused"):
            next(second)
        with pytest.raises(StopIteration):  # the refused call ended; it never runs later
            next(second)
        turns.run_to_end(first)
        assert b.pending_calls == 0


# ---- the slot itself --------------------------------------------------------------------------------
def test_a_call_from_inside_a_running_call_on_the_same_thread_is_refused():
    slot = CallSlot("a slot")
    with slot.call("outer"):
        with pytest.raises(CallInProgressError, match="inner refused on a slot: its call outer is running on this "
                                                      "thread; a call cannot be made from inside another"):
            with slot.call("inner"):
                pass
        assert slot.active is not None and slot.active.name == "outer"
    assert slot.active is None


def test_a_running_call_on_another_thread_is_waited_for():
    slot = CallSlot("a slot")
    entered, release, order = threading.Event(), threading.Event(), []

    def hold() -> None:
        with slot.call("first"):
            entered.set()
            release.wait(HANG_S)
            order.append("first")

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(HANG_S)
    waiter = threading.Thread(target=lambda: (slot.call("second").__enter__(), order.append("second")))
    waiter.start()
    release.set()
    waiter.join(HANG_S)
    holder.join(HANG_S)
    assert order == ["first", "second"]


def _stepped(n: int, log: list[int]) -> turns.Steps[int]:
    for i in range(n):
        log.append(i)
        yield
    return n


def test_a_waiter_through_a_pause_gets_the_slot_when_the_call_ends():
    """``wait_if_paused`` (a sampler apart from the trainer syncing its weights, ``close`` from another
    thread): it waits for the paused call to end instead of being refused."""
    slot, log, got = CallSlot("a slot"), [], threading.Event()
    call = slot.stepped("stepped", _stepped(3, log))
    next(call)
    assert slot.active is not None and slot.active.paused

    def wait_then_take() -> None:
        with slot.call("sync", wait_if_paused=True):
            got.set()

    waiter = threading.Thread(target=wait_then_take)
    waiter.start()
    assert not got.wait(0.2)  # still paused: it waits (a slower machine only waits longer)
    assert turns.run_to_end(call) == 3
    assert got.wait(HANG_S)
    waiter.join(HANG_S)
    assert log == [0, 1, 2] and slot.active is None


def test_a_waiter_is_refused_once_the_running_call_pauses():
    slot = CallSlot("a slot")
    in_step, resume, errors = threading.Event(), threading.Event(), []

    def blocking_steps() -> turns.Steps[None]:
        in_step.set()
        resume.wait(HANG_S)
        yield
        return None

    call = slot.stepped("stepped", blocking_steps())
    driver = threading.Thread(target=lambda: next(call))
    driver.start()
    assert in_step.wait(HANG_S)  # the call is running its first step on the driver's thread

    def other() -> None:
        try:
            with slot.call("other"):
                pass
        except CallInProgressError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=other)
    waiter.start()
    resume.set()  # the step ends, the call pauses: the waiter is refused, not served
    waiter.join(HANG_S)
    driver.join(HANG_S)
    assert len(errors) == 1 and "its call stepped is paused" in str(errors[0])
    call.close()
    assert slot.active is None
