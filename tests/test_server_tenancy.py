"""``skyrl-sdk serve`` with many LoRA clients on one base: sharing, isolation, offload,
the memory budget and the ``/api/v1/loaded`` endpoint (real server, tinker client)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _server_harness import API_KEY, ServerThread, raw_client, wait_result
from skyrl_sdk import Backend, types
from skyrl_sdk.server.compute.memory import weight_bytes
from skyrl_sdk.testing import make_sft_data

BOB = "tml-bob"
RANK = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = weight_bytes("tiny", 4)
    # room for the shared base and a sampler copy, not for a full fine-tuning copy (4x)
    with ServerThread(tmp_path_factory.mktemp("state"), api_keys={BOB: "bob"}, share_base=True, max_lora_adapters=1,
                      max_memory=3 * base) as srv:
        yield srv


def _tinker(d: types.Datum) -> tt.Datum:
    return tt.Datum(model_input=tt.ModelInput.from_ints(d.model_input.to_ints()),
                    loss_fn_inputs={k: tt.TensorData.from_numpy(v.to_numpy()) for k, v in d.loss_fn_inputs.items()})


def test_interleaved_clients_equal_solo_backends_and_share_one_base(server):
    data = [make_sft_data([6, 9], seed=s) for s in range(2)]
    adam = dict(learning_rate=1e-2)
    sc = server.service_client()
    clients = [sc.create_lora_training_client(base_model="tiny", rank=RANK, seed=s).result() for s in (7, 8)]
    solos = [Backend("tiny", lora=types.LoraConfig(rank=RANK, seed=s)) for s in (7, 8)]
    for step in range(2):
        # every call switches client: with --max-lora-adapters 1 each switch offloads the other
        futures = [c.forward_backward([_tinker(d) for d in data[step]], "cross_entropy") for c in clients]
        for f in futures:
            f.result()
        for c in clients:
            c.optim_step(tt.AdamParams(**adam)).result()
        for s in solos:
            s.forward_backward(data[step], "cross_entropy")
            s.optim_step(types.AdamParams(**adam))
    for c, s in zip(clients, solos, strict=True):
        got = c.forward([_tinker(d) for d in data[0]], "cross_entropy").result()
        want = s.forward(data[0], "cross_entropy")
        for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(g["logprobs"].to_numpy(), w["logprobs"].to_numpy())
        s.close()

    with raw_client(server) as http:
        doc = http.get("/api/v1/loaded").json()
    [base] = doc["bases"]
    assert base["model"] == "tiny" and base["max_adapters"] == 1
    assert len(base["adapters"]) == 2 and base["adapters_in_memory"] == 1
    assert sum(a["offloaded"] for a in base["adapters"]) == 1 and base["offloads"] >= 3
    mine = {a["model_id"] for a in base["adapters"]}
    assert mine == {c.model_id for c in clients}
    resident = [a for a in base["adapters"] if not a["offloaded"]]
    assert 0 < resident[0]["bytes"] < 0.15 * base["base_bytes"]
    assert doc["own_copies"] == []
    assert {a["owner"] for a in base["adapters"]} == {"default"}  # an operator (the --api-key holder) sees owners
    with raw_client(server, api_key=BOB) as http:  # another owner sees the base's totals, none of the adapters
        other = http.get("/api/v1/loaded").json()
    assert other["bases"][0]["adapters"] == [] and other["bases"][0]["adapters_in_memory"] == 1
    sc.close("success").result()


def test_base_sampling_shares_the_base(server):
    sc = server.service_client()
    sampler = sc.create_sampling_client(base_model="tiny").result()
    out = sampler.sample(tt.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                         sampling_params=tt.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(out.sequences[0].tokens) <= 4
    with raw_client(server) as http:
        doc = http.get("/api/v1/loaded").json()
    assert len(doc["bases"]) == 1 and doc["own_copies"] == []
    sc.close("success").result()


def test_full_fine_tuning_beyond_the_memory_budget_is_refused(server):
    with raw_client(server) as http:
        sid = http.post("/api/v1/create_session", json={}).json()["session_id"]
        fut = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0,
                                                      "base_model": "tiny"}).json()
        answer = wait_result(http, fut["request_id"]).json()
        assert answer["category"] == "user"
        assert "--max-memory" in answer["error"] and "full fine-tuning" in answer["error"]
        doc = http.get("/api/v1/loaded").json()
    assert doc["own_copies"] == [] and doc["memory"]["max_memory_bytes"] == 3 * weight_bytes("tiny", 4)


def test_loaded_needs_a_key(server):
    with raw_client(server, api_key=None) as http:
        assert http.get("/api/v1/loaded").status_code == 401
    assert API_KEY


def test_loaded_lists_only_the_callers_own_models_and_no_server_path(tmp_path):
    """Bob's sampler of his exported checkpoint is an own copy: Bob sees it, named by its
    ``tinker://`` path; Carol (another owner, no operator) sees neither it nor his adapter, and
    no answer holds the state dir's path or his checkpoint's name."""
    with ServerThread(tmp_path / "state", api_key=None, api_keys={BOB: "bob", "tml-carol": "carol"}) as srv:
        sc = srv.service_client(api_key=BOB)
        tc = sc.create_lora_training_client(base_model="tiny", rank=RANK).result()
        path = tc.save_weights_for_sampler("bobs-secret-export").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        sampler.sample(tt.ModelInput.from_ints([1, 2]), 1, tt.SamplingParams(max_tokens=2)).result()
        with raw_client(srv, api_key=BOB) as http:
            bob = http.get("/api/v1/loaded").json()
        with raw_client(srv, api_key="tml-carol") as http:
            carol = http.get("/api/v1/loaded")
        assert [c["model"] for c in bob["own_copies"]] == [path]  # his sampler copy, as its tinker:// path
        assert [a["model_id"] for a in bob["bases"][0]["adapters"]] == [tc.model_id]
        doc = carol.json()
        assert doc["own_copies"] == [] and doc["bases"][0]["adapters"] == []
        for text in (carol.text, str(bob)):
            assert str(srv.config.state_dir.resolve()) not in text and "runs/run-" not in text
        assert "bobs-secret-export" not in carol.text and tc.model_id not in carol.text
        sc.close("success").result()
