"""A local Hugging Face directory as the model, with tied embeddings (Llama-3.2 style)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.models.loading import TINY_DIR, load_tokenizer, tiny_config
from skyrl_sdk.testing import assert_tensors_close, make_sft_data, weights_of


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = tiny_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    directory = tmp_path_factory.mktemp("tied")
    model.save_pretrained(str(directory))
    load_tokenizer(str(TINY_DIR)).save_pretrained(str(directory))
    return directory


def test_tied_model_trains_saves_exports_and_resumes(tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    data = make_sft_data([7, 5], seed=8)
    adam = types.AdamParams(learning_rate=1e-2)
    with skyrl_sdk.Backend(model=str(tied_model_dir)) as b:
        emb = b.engine.loaded.module.get_input_embeddings().weight
        assert emb is b.engine.loaded.module.get_output_embeddings().weight
        b.forward_backward(data)
        b.optim_step(adam)
        b.save_state(tmp_path / "state")
        b.save_weights_for_sampler(tmp_path / "hf")
        want = b.forward(data).loss_fn_outputs
        b.forward_backward(data)
        b.optim_step(adam)
        after = weights_of(b)
        assert b.get_info().tokenizer_dir == str(tied_model_dir)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert exported.get_input_embeddings().weight is exported.get_output_embeddings().weight
    with torch.no_grad():
        for d, w in zip(data, want, strict=True):
            logits = exported(input_ids=torch.from_numpy(d.model_input.to_numpy()).unsqueeze(0)).logits[0]
            lp = torch.log_softmax(logits.float(), -1).gather(
                1, torch.from_numpy(d.loss_fn_inputs["target_tokens"].array).unsqueeze(1)).squeeze(1)
            np.testing.assert_allclose(lp.numpy(), w["logprobs"].to_numpy(), atol=2e-5)
    with skyrl_sdk.Backend(model=str(tied_model_dir)) as resumed:
        resumed.load_state(tmp_path / "state")
        module = resumed.engine.loaded.module
        assert module.get_input_embeddings().weight is module.get_output_embeddings().weight
        resumed.forward_backward(data)
        resumed.optim_step(adam)
        assert_tensors_close(weights_of(resumed), after, atol=1e-6)
