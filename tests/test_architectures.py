"""Any Hugging Face causal LM, policy and critic: a matrix over eight families.

Each family is a tiny random config (hidden 64, 2 layers) built here and saved as an HF
directory. Checked per family: the SDK's logprobs equal transformers' own forward
(including Gemma's soft-capped logits through the chunked lm_head path), LoRA trains and its
merged export reproduces the trained logprobs, the critic (backbone + value head) trains and
its export loads back to the same values, and a bfloat16 engine runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

import skyrl_sdk
from arch_models import FAMILIES, make_family_dir
from skyrl_sdk import errors, types
from skyrl_sdk.testing import make_sft_data

TOL = 1e-4
LENGTHS = [7, 12, 5]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return make_family_dir(request.param, tmp_path_factory.mktemp(request.param) / "model")


def _reference_logprobs(model_dir, data) -> list[np.ndarray]:
    """transformers' own forward, one datum at a time: log_softmax of the logits at the targets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for d in data:
            ids = torch.as_tensor(d.model_input.to_ints()).unsqueeze(0)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            targets = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy()).long()
            out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy())
    return out


def _logprobs(backend, data) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in backend.forward(data).loss_fn_outputs]


def _assert_close(a: list[np.ndarray], b: list[np.ndarray], atol: float) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=f"datum {i}")


def test_logprobs_equal_transformers_forward(family_dir):
    data = make_sft_data(LENGTHS, seed=1)
    with skyrl_sdk.Backend(model=str(family_dir)) as b:
        ours = _logprobs(b, data)
    _assert_close(ours, _reference_logprobs(family_dir, data), TOL)


def test_lora_trains_and_merged_export_reproduces_logprobs(family_dir, tmp_path):
    data = make_sft_data(LENGTHS, seed=2)
    with skyrl_sdk.Backend(model=str(family_dir), lora=types.LoraConfig(rank=4), seed=3) as b:
        losses = []
        for _ in range(3):
            losses.append(b.forward_backward(data).metrics["loss:sum"])
            b.optim_step(types.AdamParams(learning_rate=1e-2))
        assert losses[-1] < losses[0]
        trained = _logprobs(b, data)
        b.save_weights_for_sampler(tmp_path / "merged")
    _assert_close(_reference_logprobs(tmp_path / "merged", data), trained, TOL)


def _critic_data(seed: int):
    rng = np.random.default_rng(seed)
    data = []
    for n in LENGTHS:
        tokens = rng.integers(0, 256, n)
        returns = ((tokens % 5) / 2.0 - 1.0).astype(np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                loss_fn_inputs={"values": np.zeros(n, np.float32), "returns": returns}))
    return data


def _values(backend, data) -> list[np.ndarray]:
    return [o["values"].to_numpy() for o in backend.forward(data).loss_fn_outputs]


def test_critic_trains_exports_and_loads_back(family_dir, tmp_path):
    from transformers import AutoModel

    data = _critic_data(4)
    with skyrl_sdk.Backend(model=str(family_dir), role="critic") as critic:
        losses = []
        for _ in range(4):
            losses.append(critic.forward_backward(data).metrics["loss:sum"])  # default loss: value
            critic.optim_step(types.AdamParams(learning_rate=1e-3))
        assert losses[-1] < losses[0]
        trained = _values(critic, data)
        with pytest.warns(errors.CriticExportWarning):  # no lm_head: says how to load it
            critic.save_weights_for_sampler(tmp_path / "critic")
    export = tmp_path / "critic"
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"value_head.weight", "value_head.bias"} <= names and not any(n.startswith("lm_head") for n in names)
    AutoModel.from_pretrained(str(export))  # the backbone loads with plain transformers
    with skyrl_sdk.Backend(model=str(export), role="critic") as again:
        _assert_close(_values(again, data), trained, 1e-5)


def test_bfloat16_engine_runs(family_dir):
    """The engine's dtype (bf16 weights here; compute-dtype autocast is the precision work's)."""
    data = make_sft_data(LENGTHS, seed=5)
    with skyrl_sdk.Backend(model=str(family_dir), engine_config={"dtype": "bfloat16"}) as b:
        out = b.forward_backward(data)
        b.optim_step(types.AdamParams(learning_rate=1e-4))
        lp = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in lp)
    _assert_close(lp, _reference_logprobs(family_dir, data), 0.15)  # bf16 rounding of a 320-way softmax
