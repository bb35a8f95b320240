"""Prefix sharing on every family the SDK is tested on (tests/arch_models.py): shared rows give
the unshared logprobs and gradients (float32), with each family's attention quirks: sliding
windows (Gemma2/3 every other layer, Mistral/Qwen2/Phi3 forced to a short window here),
attention soft-capping and the eager implementation (Gemma2), GQA, MoE, QK norms; plus LoRA,
the critic and activation checkpointing on a few of them."""

from __future__ import annotations

import json

import pytest

import skyrl_sdk
from arch_models import FAMILIES, make_family_dir
from skyrl_sdk import types
from skyrl_sdk.testing import grads_of, make_group_data
from test_prefix_sharing import OFF, RL, _compare, _only, _shares

#: a short sliding window on families whose default is none or 4096 (the test rows are ~40 tokens)
WINDOW = {"mistral": dict(sliding_window=8), "phi3": dict(sliding_window=8),
          "qwen2": dict(sliding_window=8, use_sliding_window=True, max_window_layers=1)}
CASES = sorted(FAMILIES) + [f"{f}+window" for f in sorted(WINDOW)] + ["qwen2+eager"]


@pytest.fixture(scope="module", params=CASES)
def family_dir(request, tmp_path_factory):
    family, _, variant = request.param.partition("+")
    path = make_family_dir(family, tmp_path_factory.mktemp(request.param.replace("+", "_")) / "model",
                           **(WINDOW[family] if variant == "window" else {}))
    if variant == "eager":  # transformers reads the implementation from config.json
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    return path


def test_shared_equals_unshared(family_dir):
    data = make_group_data(((24, 3), (30, 4)), seed=20)
    with skyrl_sdk.Backend(model=str(family_dir), dialect="native") as shared, \
            skyrl_sdk.Backend(model=str(family_dir), dialect="native", engine_config=OFF) as plain:
        assert shared.get_info().prefix_sharing.startswith("on"), shared.get_info().prefix_sharing
        assert _shares(shared, data)
        _compare(shared, plain, data, "regular", {"kl_coef": 0.1, "entropy_coef": 0.01})


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_lora_critic_and_checkpointing(family, tmp_path):
    path = make_family_dir(family, tmp_path / "model")
    data = _only(make_group_data(seed=21), *RL)
    lora = types.LoraConfig(rank=4, seed=1)
    with skyrl_sdk.Backend(model=str(path), lora=lora, engine_config={"gradient_checkpointing": True}) as shared, \
            skyrl_sdk.Backend(model=str(path), lora=lora, engine_config=OFF) as plain:
        for b in (shared, plain):  # lora_B starts at zero: one step makes every adapter matter
            b.forward_backward(data, "importance_sampling")
            b.optim_step(types.AdamParams(learning_rate=1e-2))
        assert grads_of(shared) == {}
        _compare(shared, plain, data, "importance_sampling")
    critic_data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "values": d.loss_fn_inputs["logprobs"], "returns": d.loss_fn_inputs["advantages"]}) for d in data]
    with skyrl_sdk.Backend(model=str(path), role="critic") as shared, \
            skyrl_sdk.Backend(model=str(path), role="critic", engine_config=OFF) as plain:
        assert _shares(shared, critic_data)
        _compare(shared, plain, critic_data, "value")
