"""Every forward_backward / forward / sample output carries its tokens per second, and MFU when the
device's peak is known (the table by GPU name, or ``engine_config["peak_tflops"]``), checked
against FLOPs counted independently from the model's own modules."""

from __future__ import annotations

import numpy as np
import pytest

import skyrl_sdk
from skyrl_sdk import errors, types
from skyrl_sdk.engines import throughput


def _data(lengths=(17, 40, 9)):
    rng = np.random.default_rng(0)
    return [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(3, 300, n).tolist()),
                        loss_fn_inputs={"target_tokens": rng.integers(3, 300, n).tolist()}) for n in lengths]


def _reference_forward_flops(module, lengths) -> float:
    """2 x (parameters a token passes through) per token, plus causal attention: each token
    attends to itself and those before it, 4 x heads x head_dim FLOPs per pair and layer."""
    inner = module.model if hasattr(module, "model") else module
    config = module.config
    embedding = inner.get_input_embeddings().weight
    head = module.get_output_embeddings().weight
    matmul = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    if embedding is not head:
        matmul -= embedding.numel()  # a lookup, no FLOPs
    width = config.num_attention_heads * config.head_dim
    pairs = sum(t * (t + 1) // 2 for t in lengths)
    return 2.0 * matmul * sum(lengths) + 4.0 * config.num_hidden_layers * width * pairs


@pytest.mark.parametrize("lora", [None, {"rank": 4}])
def test_training_calls_carry_tokens_per_second_and_mfu(lora):
    data = _data()
    lengths = [d.model_input.length for d in data]
    peak = 0.002  # TFLOP/s: the override (CPU has no table entry)
    with skyrl_sdk.Backend(model="tiny", lora=lora, engine_config={"peak_tflops": peak}) as b:
        forward_flops = _reference_forward_flops(b.engine.loaded.module.base_model.model if lora else
                                                 b.engine.loaded.module, lengths)
        for call, factor in ((b.forward_backward, 2.0 if lora else 3.0), (b.forward, 1.0)):
            m = call(data, "cross_entropy").metrics
            seconds = m["seconds:sum"]
            assert seconds > 0
            assert m["tokens_per_second:mean"] == pytest.approx(sum(lengths) / seconds, rel=1e-12)
            assert m["mfu:mean"] == pytest.approx(factor * forward_flops / seconds / (peak * 1e12), rel=1e-9)
            assert m["num_tokens:sum"] == sum(lengths)  # the loss's metrics are all still there
            assert set(throughput.without_throughput(m)) == set(m) - {"tokens_per_second:mean", "seconds:sum",
                                                                      "mfu:mean"}


def test_no_mfu_without_a_known_peak():
    with skyrl_sdk.Backend(model="tiny") as b:  # CPU: no table entry, no override
        m = b.forward(_data(), "cross_entropy").metrics
    assert "tokens_per_second:mean" in m and "mfu:mean" not in m


def test_sample_outputs_carry_tokens_per_second_and_mfu():
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with skyrl_sdk.Backend(model="tiny", engine_config={"peak_tflops": 0.002}) as b:
        outs = b.sample(prompts, {"max_tokens": 6, "stop": [], "seed": 1}, num_samples=2)
        module = b.engine.loaded.module
    m = outs[0].metrics
    assert all(o.metrics is m for o in outs)  # the call's figures, on each of its outputs
    sampled = [[len(s.tokens) for s in o.sequences] for o in outs]
    assert sampled == [[6, 6], [6, 6]]
    assert m["sampled_tokens:sum"] == 24 and m["prompt_tokens:sum"] == 7
    assert m["tokens_per_second:mean"] == pytest.approx(24 / m["seconds:sum"], rel=1e-12)
    # each prompt once, then each sampled token at its context length (prompt + its position)
    config = module.config
    per_token = _reference_forward_flops(module, [1]) - 4.0 * config.num_hidden_layers * config.num_attention_heads \
        * config.head_dim  # 2N: one token without its attention
    width = config.num_attention_heads * config.head_dim
    flops = _reference_forward_flops(module, [4, 3])
    for p, lengths in zip((4, 3), sampled, strict=True):
        for g in lengths:
            flops += per_token * g + 4.0 * config.num_hidden_layers * width * sum(p + j for j in range(1, g + 1))
    assert m["mfu:mean"] == pytest.approx(flops / m["seconds:sum"] / 2e9, rel=1e-9)


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
    ("NVIDIA H100 PCIe", "bfloat16", 756.0),
    ("NVIDIA H200", "float32", 66.9),
    ("NVIDIA A100-SXM4-80GB", "float32", 19.5),
    ("NVIDIA L40S", "bfloat16", 362.05),  # not L4's
    ("NVIDIA L4", "bfloat16", 121.0),
    ("NVIDIA GeForce RTX 4090", "bfloat16", None),  # not in the table: no MFU
    ("NVIDIA B200", "float32", None),  # listed, but not for this dtype
])
def test_the_peak_table_by_gpu_name(name, dtype, tflops):
    got = throughput.peak_flops("cuda", name, dtype)
    assert got == (None if tflops is None else tflops * 1e12)


def test_the_peak_override_wins_and_cpu_has_none():
    assert throughput.peak_flops("cuda", "NVIDIA H100 80GB HBM3", "bfloat16", override_tflops=500.0) == 500e12
    assert throughput.peak_flops("cpu", None, "float32") is None
    assert throughput.peak_flops("cpu", None, "float32", override_tflops=1.5, devices=2) == 3e12


def test_a_bad_peak_is_refused_by_name():
    with pytest.raises(errors.InputError, match=r"engine_config\['peak_tflops'\]"):
        skyrl_sdk.Backend(model="tiny", engine_config={"peak_tflops": -1})
