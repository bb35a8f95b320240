"""Sharded loading (meta device, each rank reads its own slices) and streamed exports.

fsdp (2 gloo ranks) must equal the local engine on models of other families read from HF
directories: Qwen2 (biases; read slice by slice, with seeded LoRA adapters made on the meta
model) and Qwen3-MoE (fused experts that transformers converts on load: rank 0 loads and
scatters); Gemma2's tied, soft-capped head as a critic (value head, tied embeddings).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("skyrl_sdk_fsdp")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the family builders

from fsdp_testutil import ONE_PER_MICRO_BATCH
from safetensors.torch import load_file

import skyrl_sdk
from arch_models import make_family_dir
from skyrl_sdk import errors, types
from skyrl_sdk.engines.export import SafetensorsStream, write_hf_weights_stream, write_tensor_stream
from skyrl_sdk.testing import assert_outputs_close, assert_tensors_close, grads_of, make_sft_data, torch_threads

LENGTHS = [7, 12, 3, 9]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _pair(model_dir, **kwargs):
    fsdp = skyrl_sdk.Backend(model=str(model_dir), engine="fsdp",
                             engine_config={"world_size": 2, **ONE_PER_MICRO_BATCH}, **kwargs)
    local = skyrl_sdk.Backend(model=str(model_dir), engine_config=ONE_PER_MICRO_BATCH, **kwargs)
    return fsdp, local


def _files(path: Path) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(path)).items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("family,source,lora", [("qwen2", "files", True), ("qwen3_moe", "rank0", False)])
def test_sharded_load_equals_local(family, source, lora, tmp_path):
    model_dir = make_family_dir(family, tmp_path / family)
    kwargs = {"lora": types.LoraConfig(rank=4, seed=11)} if lora else {}
    fsdp, local = _pair(model_dir, **kwargs)
    try:
        assert fsdp.engine.weights_loaded_from == source
        # the initial weights: bit-identical (read from the same files / drawn from the same seed)
        fsdp.save_weights_for_sampler(tmp_path / "f0")
        local.save_weights_for_sampler(tmp_path / "l0")
        assert_tensors_close(_files(tmp_path / "f0" / "model.safetensors"),
                            _files(tmp_path / "l0" / "model.safetensors"), atol=0.0, what="initial export")
        data = make_sft_data(LENGTHS, seed=3)
        out_f, out_l = fsdp.forward_backward(data), local.forward_backward(data)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-6, rtol=1e-5, what="grad")
        adam = types.AdamParams(learning_rate=1e-3)
        fsdp.optim_step(adam)
        local.optim_step(adam)
        assert_outputs_close(fsdp.forward(data), local.forward(data), atol=1e-5)
        # full-format state: streamed from the shards, same names and values as the local engine's
        fsdp.save_state(tmp_path / "fs")
        local.save_state(tmp_path / "ls")
        for name in ("model.safetensors", "optimizer.safetensors"):
            assert_tensors_close(_files(tmp_path / "fs" / name), _files(tmp_path / "ls" / name), atol=1e-5, what=name)
    finally:
        fsdp.close()
        local.close()


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_critic_on_tied_softcapped_family(tmp_path):
    model_dir = make_family_dir("gemma2", tmp_path / "gemma2")
    fsdp, local = _pair(model_dir, role="critic")
    try:
        assert fsdp.engine.weights_loaded_from == "files"  # the tied lm_head is not part of a critic
        rng = np.random.default_rng(0)
        data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 256, n)),
                            loss_fn_inputs={"values": np.zeros(n, np.float32),
                                            "returns": rng.normal(size=n).astype(np.float32)}) for n in LENGTHS]
        out_f, out_l = fsdp.forward_backward(data), local.forward_backward(data)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-6, rtol=1e-5, what="grad")
        with pytest.warns(errors.CriticExportWarning) as caught:  # a critic's export: no lm_head
            fsdp.save_weights_for_sampler(tmp_path / "f")
            local.save_weights_for_sampler(tmp_path / "l")
        assert len(caught) == 2 and (tmp_path / "f" / "README.md").is_file()
        assert_tensors_close(_files(tmp_path / "f" / "model.safetensors"),
                            _files(tmp_path / "l" / "model.safetensors"), atol=0.0, what="critic export")
    finally:
        fsdp.close()
        local.close()


# ---- the streamed safetensors writer (no processes) -----------------------------------------
def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "d": torch.randn(4, 4, generator=g).to(torch.float16),
    }


def test_stream_writes_what_safetensors_reads(tmp_path):
    tensors = _tensors()
    plan = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    write_tensor_stream(tmp_path / "x.safetensors", plan, iter(tensors.values()), metadata={"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_stream_shards_with_an_index(tmp_path):
    import json

    tensors = _tensors()
    plan = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    write_hf_weights_stream(tmp_path, plan, iter(tensors.values()), max_shard_bytes=64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert len(set(index["weight_map"].values())) > 1
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / file))[name], tensors[name])


def test_stream_refuses_a_tensor_that_does_not_match_its_plan(tmp_path):
    stream = SafetensorsStream(tmp_path / "x.safetensors", [("a", (2, 2), torch.float32)])
    with pytest.raises(ValueError, match="a: got"):
        stream.write(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ended before"):
        stream.close()
