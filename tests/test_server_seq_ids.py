"""seq_ids the client numbered but never sent do not stall a model (futures.Sequencer).

The tinker client numbers every training request and sends request n + 1 only once request
n's submission was answered or failed on its side; this server asks for forward_backward
chunks one after another. So a request shows every seq_id below it was submitted: a
missing one is skipped after a short grace (3 s; ids arriving out of order within it keep
their order), not after the 60 s idle gap (these tests set that to the hang limit, so only
the boundary rule can let the later request run)."""

from __future__ import annotations

import asyncio
import time

import pytest

from _limits import HANG_S
from _server_harness import ServerThread, next_token_datum
from skyrl_sdk.server.compute.executor import Executor
from skyrl_sdk.server.compute.futures import Job, Result, Sequencer


def _recorder():
    ran: list[int] = []
    answers: dict[int, Result] = {}

    def job(i):
        def run():
            ran.append(i)
            return Result.json({})
        return Job(run=run, done=lambda r: answers.__setitem__(i, r))

    return ran, answers, job


def _run(steps, grace: float = 0.0, pause: float = 0.0) -> tuple[list[int], dict[int, Result], Sequencer]:
    """Submit ``(seq_id, boundary)`` steps ``pause`` seconds apart to a sequencer whose
    boundaries wait ``grace`` seconds."""
    ran, answers, job = _recorder()

    async def main():
        worker = Executor("t", dedicated=True).queue("t", "alice")
        seq = Sequencer(worker, next_seq=1, gap_timeout_s=HANG_S, boundary_grace_s=grace)
        for seq_id, boundary in steps:
            seq.submit(seq_id, job(seq_id), boundary=boundary)
            await asyncio.sleep(pause)
        deadline = time.monotonic() + HANG_S
        while len(answers) < len(steps) and time.monotonic() < deadline:  # each step answered, run or refused
            await asyncio.sleep(0.02)
        worker.close()
        return seq

    seq = asyncio.run(main())
    return ran, answers, seq


def test_a_boundary_skips_the_missing_ids_at_once_and_keeps_order():
    ran, answers, seq = _run([(1, True), (3, True), (4, True)])  # 2 was numbered, never sent
    assert ran == [1, 3, 4] and seq.next_seq == 5


def test_chunks_of_a_parallel_call_still_wait_for_each_other():
    """Not boundaries: 3 waits for 2 (a sibling chunk on its way), then both run in order."""
    ran, answers, seq = _run([(1, True), (3, False), (2, False)])
    assert ran == [1, 2, 3]


def test_a_waiting_chunk_runs_once_a_boundary_proves_the_gap():
    ran, answers, seq = _run([(1, True), (3, False), (5, True)])  # 2 and 4 never come
    assert ran == [1, 3, 5]


def test_ids_that_arrive_out_of_order_within_the_grace_keep_their_order():
    """A client of its own sends 3 (a boundary) before 2: within the grace (here longer than
    the test) 2 still runs first."""
    ran, answers, seq = _run([(1, True), (3, True), (2, True)], grace=HANG_S, pause=0.05)
    assert ran == [1, 2, 3]


def test_the_grace_ends_and_the_gap_is_skipped():
    ran, answers, seq = _run([(1, True), (3, True)], grace=0.2)  # waits for the grace, then runs 3
    assert ran == [1, 3] and seq.next_seq == 4


def test_a_skipped_id_that_arrives_late_is_refused_not_run_out_of_order():
    ran, answers, seq = _run([(1, True), (3, True), (2, True)])
    assert ran == [1, 3]
    assert answers[2].failed and b"arrived after later requests" in answers[2].body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), gap_timeout_s=HANG_S) as srv:
        yield srv


def test_a_request_the_client_could_not_send_does_not_stall_the_next(server):
    """An ImageAssetPointerChunk fails in the client (seq_id consumed, nothing sent); the
    next forward_backward and optim_step are answered without waiting for it."""
    from tinker import types as tt

    service = server.service_client()
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result(timeout=HANG_S)
    good = next_token_datum(6)
    trainer.forward_backward([good], "cross_entropy").result(timeout=HANG_S)
    image = tt.Datum(model_input=tt.ModelInput(chunks=[tt.ImageAssetPointerChunk(format="png", location="x.png")]),
                     loss_fn_inputs={"target_tokens": [1]})
    with pytest.raises(Exception, match="Unsupported model input chunk type"):
        trainer.forward_backward([image], "cross_entropy").result(timeout=HANG_S)
    out = trainer.forward_backward([good], "cross_entropy").result(timeout=HANG_S)
    assert out.metrics["loss:sum"] > 0
    assert trainer.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=HANG_S).metrics["grad_norm"] > 0
    model = server.runtime.models[trainer.model_id]
    assert model.sequencer.next_seq == 5 and model.sequencer.held() == []


def test_seq_id_rules_are_one_for_json_and_protobuf(server):
    """Issue 41, item 18. Before: JSON seq_id 0 on a fresh model failed as a "server" error
    saying it "arrived after later requests ran" (none had), and a protobuf seq_id of -5 ran
    outside the order where JSON refused -1. Now both forms refuse any seq_id but 1..int64 as a
    user error naming the field, and the model's order is untouched (the next request, 1, runs)."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    from _server_harness import raw_client, wait_result

    with raw_client(server) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()
        model_id = wait_result(http, fut["request_id"]).json()["model_id"]
        errors = []
        for seq_id in (0, -1):
            answer = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id}).json()
            errors.append(wait_result(http, answer["request_id"]).json())
        msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=-5, loss_fn="cross_entropy")
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.arange(1, 4, dtype=np.int32).tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.arange(2, 5).tobytes(), dtype=pb.DTYPE_INT64,
                                                                 shape=[3]))
        answer = http.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                           headers={"Content-Type": "application/x-protobuf"}).json()
        errors.append(wait_result(http, answer["request_id"]).json())
        for error, seq_id in zip(errors, (0, -1, -5), strict=True):
            assert error["category"] == "user", error
            assert error["error"].startswith(f"seq_id: expected an integer in 1..{2**63 - 1}, got {seq_id} "), error
        assert server.runtime.models[model_id].sequencer.next_seq == 1  # nothing ran, nothing was skipped
        answer = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1}).json()
        assert "metrics" in wait_result(http, answer["request_id"]).json()
        http.post(f"/api/v1/sessions/{sid}/finish", json={})
