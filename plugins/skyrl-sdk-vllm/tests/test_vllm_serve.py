"""``skyrl-sdk serve --sampler vllm``, started as a user starts it, driven by the official tinker
client: samples equal the trainer's ``forward``, follow each step with no user action (the
LoRA clients' adapters go to the one vLLM engine of the shared base), and the server says
which sampler serves (get_info, its log, the console's operator view)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from vllm_testutil import HANG_S, SMALL

tinker = pytest.importorskip("tinker")
from tinker import types as tt

PROMPT = list(range(5, 30))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "skyrl_sdk.cli", "serve", "--port", str(port), "--state-dir",
                             str(tmp_path_factory.mktemp("state")), "--sampler", "vllm", "--sampler-config",
                             json.dumps(SMALL)], env=env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG_S
    while not any("listening on" in line for line in log):
        assert proc.poll() is None, "".join(log)[-5000:]
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)
    yield url, log
    proc.terminate()
    proc.wait(timeout=HANG_S)


def _forward(tc, tokens: list[int]) -> np.ndarray:
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))})
    return tc.forward([datum], "cross_entropy").result(timeout=HANG_S).loss_fn_outputs[0]["logprobs"].to_numpy()


def _assert_samples_are_forwards(tc, sampler) -> list[list[int]]:
    params = tt.SamplingParams(max_tokens=8, seed=4, temperature=1.0)
    out = sampler.sample(tt.ModelInput.from_ints(PROMPT), 2, params).result(timeout=HANG_S)
    for s in out.sequences:
        want = _forward(tc, PROMPT + list(s.tokens))[len(PROMPT) - 1:]
        np.testing.assert_allclose(np.array(s.logprobs, dtype=np.float32), want, atol=1e-3)
    return [list(s.tokens) for s in out.sequences]


def test_lora_clients_sample_through_vllm_and_stay_in_sync(server):
    url, log = server
    service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(timeout=HANG_S)
    first = tc.save_weights_and_get_sampling_client().result(timeout=HANG_S)
    before = _assert_samples_are_forwards(tc, first)
    data = [tt.Datum(model_input=tt.ModelInput.from_ints(PROMPT[:-1]),
                     loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(np.array(PROMPT[1:], dtype=np.int64))})]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result(timeout=HANG_S)
        tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result(timeout=HANG_S)
    after = _assert_samples_are_forwards(tc, tc.save_weights_and_get_sampling_client().result(timeout=HANG_S))
    assert after != before
    # the first client pinned the weights it was made from (a snapshot: another adapter version)
    again = first.sample(tt.ModelInput.from_ints(PROMPT), 2, tt.SamplingParams(max_tokens=8, seed=4)).result(
        timeout=HANG_S)
    assert [list(s.tokens) for s in again.sequences] == before
    base = service.create_sampling_client(base_model="tiny").result(timeout=HANG_S)
    assert len(base.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=3)).result(
        timeout=HANG_S).sequences[0].tokens) == 3
    with httpx.Client(base_url=url, timeout=HANG_S) as http:
        info = http.post("/api/v1/get_info", json={"model_id": tc.model_id}).json()
        assert info["sampler"] == "vllm"
        limits = http.get("/console/api/server").json()["limits"]
        assert (limits["sampler"], limits["sampler_config"]) == ("vllm", SMALL)
    text = "".join(log)
    assert "; sampler: vllm 0.32" in text or "; sampler: vllm 0.33" in text, text  # the banner says what serves


def test_vllms_start_up_lines_are_behind_v(server):
    """Before the banner, only serve's own lines (and one line torch's C++ prints itself): vLLM's
    ~30 INFO and routine WARNING lines, and its FutureWarnings, come with -v only."""
    _, log = server
    before = log[:next(i for i, line in enumerate(log) if "listening on" in line)]
    noise = [line for line in before if not line.startswith("skyrl-sdk serve: ")
             and not (line.startswith("[W") and "utils.cpp" in line)]
    assert noise == [], noise
