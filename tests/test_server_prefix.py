"""Prefix sharing through ``skyrl-sdk serve``: the cookbook's RL loops send a group's samples
(one prompt, several completions) in one ``forward_backward``; the served LoRA model (on a
shared base) computes the prompt once and returns what an unshared in-process Backend does.
(A group's separate sample requests, which the server merges into one ``sample([p, p, ...])``,
prefill their prompt once: tests/test_prefix_sharing.py checks that call.)"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _server_harness import ServerThread
from skyrl_sdk import Backend, types
from skyrl_sdk.testing import make_group_data

RANK, LORA_SEED = 4, 7


def _to_tinker(d: types.Datum) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(v.array) for k, v in d.loss_fn_inputs.items()})


def test_a_group_through_the_server_equals_the_unshared_backend(tmp_path):
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        k: d.loss_fn_inputs[k] for k in ("target_tokens", "logprobs", "advantages")}) for d in make_group_data(seed=40)]
    with ServerThread(tmp_path / "state") as srv, \
            Backend(model="tiny", lora=types.LoraConfig(rank=RANK, seed=LORA_SEED),
                    engine_config={"prefix_sharing": False}) as ref:
        service = srv.service_client()
        try:
            tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=LORA_SEED).result()
            backend = srv.runtime.models[tc.model_id].backend
            assert backend.get_info().prefix_sharing.startswith("on: two-part attention")
            assert any(mb.prefix is not None for mb in backend.engine.runner.plan(data))
            for _ in range(2):  # before and after a step (LoRA B is zero at first)
                got = tc.forward_backward([_to_tinker(d) for d in data], "importance_sampling").result()
                want = ref.forward_backward(data, "importance_sampling")
                for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
                    np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].array, atol=1e-5)
                np.testing.assert_allclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rtol=1e-5)
                step = tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result().metrics
                np.testing.assert_allclose(step["grad_norm"], ref.optim_step(types.AdamParams(learning_rate=1e-2))
                                           .metrics["grad_norm"], rtol=1e-4)
        finally:
            service.close("success").result()
