"""``skyrl-sdk serve --engine fsdp --engine-config '{"launcher": "ray", ...}' --sampler vllm
--sampler-config '{"placement": "ray", "engines": 2}'``, started as a user starts it (``RAY_ADDRESS``
names the cluster), driven by the official tinker client: samples equal the trainer's ``forward``
after each step, and the console's operator view shows the last weight sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from skyrl_sdk_ray.local_cluster import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "skyrl-sdk-vllm" / "tests"))
import tinker
from tinker import types as tt
from vllm_testutil import HANG_S, SMALL

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
PROMPT = list(range(5, 30))


def _datum(tokens):
    return tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))})


def test_serve_with_ray_ranks_and_ray_engines_serves_the_tinker_client(cluster, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "skyrl_sdk.cli", "serve", "--port", str(port), "--state-dir", str(tmp_path / "state"),
           "--engine", "fsdp", "--engine-config", json.dumps({"launcher": "ray", "world_size": 2}),
           "--sampler", "vllm", "--sampler-config", json.dumps({**SMALL, "placement": "ray", "engines": 2})]
    proc = subprocess.Popen(cmd, env={**os.environ, "TINKER_TELEMETRY": "0", "RAY_ADDRESS": cluster.address},
                            stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + HANG_S
        while not any("listening on" in line for line in log):
            assert proc.poll() is None, "".join(log)[-5000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        banner = next(line for line in log if "listening on" in line)
        assert "engine: fsdp; sampler: vllm 0.3" in banner and "x2 (Ray actors; weights pushed: gloo)" in banner
        url = f"http://127.0.0.1:{port}"
        service = tinker.ServiceClient(base_url=url, api_key="tml-local")
        tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(timeout=HANG_S)
        seen = []
        for _ in range(2):
            tc.forward_backward([_datum(PROMPT)], "cross_entropy").result(timeout=HANG_S)
            tc.optim_step(tt.AdamParams(learning_rate=5e-2)).result(timeout=HANG_S)
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=HANG_S)
            out = sampler.sample(tt.ModelInput.from_ints(PROMPT), 2, tt.SamplingParams(max_tokens=8, seed=4)).result(
                timeout=HANG_S)
            for s in out.sequences:
                full = PROMPT + list(s.tokens)
                want = tc.forward([_datum(full)], "cross_entropy").result(timeout=HANG_S).loss_fn_outputs[0][
                    "logprobs"].to_numpy()[len(PROMPT) - 1:]
                np.testing.assert_allclose(np.array(s.logprobs, dtype=np.float32), want, atol=1e-3)
            seen.append([list(s.tokens) for s in out.sequences])
        assert seen[0] != seen[1]
        with httpx.Client(base_url=url, timeout=HANG_S) as http:
            syncs = http.get("/console/api/server").json()["weight_syncs"]
        mine = [w for w in syncs if w["model_id"] == tc.model_id]
        assert len(mine) == 1 and mine[0]["kind"] == "lora" and mine[0]["engines"] == 2
        assert mine[0]["seconds"] > 0 and mine[0]["sampler"] == "vllm"
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_S)
