"""The colocated memory plan (docs/engines.md, "Training and sampling on one GPU") is the code's
own accounting: the docs' table is what ``engines.memory_plan`` computes, and that accounting
equals the bytes a real local engine holds (parameters, gradients, AdamW moments)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.engines import memory_plan
from skyrl_sdk.testing import make_sft_data

DOCS = Path(__file__).resolve().parents[1] / "docs" / "engines.md"


def test_the_docs_table_is_the_plan_the_code_computes():
    text = DOCS.read_text()
    table = text.split("<!-- memory-plan:start -->\n", 1)[1].split("\n<!-- memory-plan:end -->", 1)[0]
    assert table == memory_plan.markdown_table(), "regenerate it: memory_plan.markdown_table()"


def _tiny_size(module) -> memory_plan.ModelSize:
    c = module.config
    seen = {id(p): (n, p) for n, p in module.named_parameters()}.values()
    total = sum(p.numel() for n, p in seen if "lora_" not in n)  # the base (peft adds its adapters in place)
    return memory_plan.ModelSize("tiny", total, c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                                 c.num_attention_heads, c.num_key_value_heads, c.head_dim)


@pytest.mark.parametrize("rank", [None, 4])
def test_the_accounting_is_what_the_local_engine_holds(rank):
    lora = {"rank": rank, "train_unembed": False} if rank else None
    with skyrl_sdk.Backend(model="tiny", lora=lora) as b:
        b.forward_backward(make_sft_data([6, 9], seed=0), "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=1e-3))
        b.forward_backward(make_sft_data([5], seed=1), "cross_entropy")  # gradients pending again
        module = b.engine.loaded.module
        inner = module.base_model.model if rank else module
        params = {id(p): p for p in module.parameters()}.values()
        held = {"parameters": sum(p.numel() * p.element_size() for p in params),
                "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                "adamw": sum(t.numel() * t.element_size() for k, t in b.engine.runner.optimizer.state_items()
                             if not k.endswith("::step"))}
    size = _tiny_size(inner)
    planned = memory_plan.trainer_bytes(memory_plan.Setup(size, lora_rank=rank))
    assert {k: planned[k] for k in held} == held
    assert planned["kept_gradients"] == 0  # only while a call runs on top of pending gradients
    accumulating = memory_plan.trainer_bytes(memory_plan.Setup(size, lora_rank=rank, accumulate=True))
    assert accumulating["kept_gradients"] == held["gradients"]


def test_offloading_and_sleeping_move_memory_between_the_phases():
    base = memory_plan.Setup(memory_plan.QWEN_7B, lora_rank=32)
    awake = memory_plan.plan(attrs.evolve(base, sleep_level=0))
    asleep = memory_plan.plan(base)
    offloaded = memory_plan.plan(attrs.evolve(base, offload_while_sampling=True))
    # asleep, vLLM's weights leave the training phase; offloaded, the trainer leaves the sampling phase
    assert asleep["training_phase_gib"] == pytest.approx(awake["training_phase_gib"] - awake["vllm_weights_gib"]
                                                         - awake["kv_cache_gib"])
    assert offloaded["sampling_phase_gib_before_kv"] == pytest.approx(asleep["sampling_phase_gib_before_kv"]
                                                                      - asleep["trainer_gib"])
    assert offloaded["kv_cache_gib"] > asleep["kv_cache_gib"]
    # 7B full fine-tuning with fp32 masters does not fit 80 GB whatever vLLM does
    full = memory_plan.Setup(memory_plan.QWEN_7B, offload_while_sampling=True)
    assert memory_plan.trainer_bytes(full)["parameters"] == memory_plan.QWEN_7B.parameters * 4
    assert not memory_plan.plan(full)["fits"]
