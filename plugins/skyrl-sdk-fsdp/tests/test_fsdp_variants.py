"""Model variants under FSDP: LoRA, a critic (default batching), tied embeddings; the sharded state format."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("skyrl_sdk_fsdp")
pytest.importorskip("peft")

from fsdp_testutil import LENGTHS, ONE_PER_MICRO_BATCH
from safetensors.torch import load_file

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.errors import CheckpointError
from skyrl_sdk.testing import (
    assert_metrics_close,
    assert_outputs_close,
    assert_tensors_close,
    grads_of,
    make_sft_data,
    torch_threads,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LORA = types.LoraConfig(rank=4, alpha=16.0)
ADAM = types.AdamParams(learning_rate=1e-2, grad_clip_norm=20.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def lora_pair():
    fsdp = skyrl_sdk.Backend(
        model="tiny", engine="fsdp", lora=LORA,
        engine_config={"world_size": 2, "state_format": "sharded", **ONE_PER_MICRO_BATCH},
    )
    local = skyrl_sdk.Backend(model="tiny", lora=LORA, engine_config=ONE_PER_MICRO_BATCH)
    yield fsdp, local
    fsdp.close()
    local.close()


def _files(path):
    return {k: v.numpy() for k, v in load_file(str(path)).items()}


def test_lora_matches_local_lora(lora_pair, tmp_path):
    fsdp, local = lora_pair
    info = fsdp.get_info()
    assert info.is_lora and info.num_trainable_parameters == local.get_info().num_trainable_parameters
    data = make_sft_data(LENGTHS, seed=21)
    for step in range(3):
        out_f, out_l = fsdp.forward_backward(data), local.forward_backward(data)
        assert_metrics_close(out_f.metrics, out_l.metrics)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        grads = fsdp.engine.gradients()
        assert all("lora_" in name for name in grads)
        tol = 1e-6 if step == 0 else 1e-5
        assert_tensors_close(grads, grads_of(local), atol=tol, rtol=tol, what=f"grad@{step}")
        m_f, m_l = fsdp.optim_step(ADAM).metrics, local.optim_step(ADAM).metrics
        assert m_f["grad_norm"] == pytest.approx(m_l["grad_norm"], rel=1e-5)
    # merged export (what a sampler loads) and the adapter-only export
    fsdp.save_weights_for_sampler(tmp_path / "f")
    local.save_weights_for_sampler(tmp_path / "l")
    assert_tensors_close(_files(tmp_path / "f" / "model.safetensors"), _files(tmp_path / "l" / "model.safetensors"),
                        atol=5e-5, what="merged")
    fsdp.save_weights_for_sampler(tmp_path / "fa", merge_lora=False)
    local.save_weights_for_sampler(tmp_path / "la", merge_lora=False)
    assert (tmp_path / "fa" / "adapter_config.json").is_file()
    assert_tensors_close(_files(tmp_path / "fa" / "adapter_model.safetensors"),
                        _files(tmp_path / "la" / "adapter_model.safetensors"), atol=5e-5, what="adapter")


def test_sharded_state_round_trip(lora_pair, tmp_path):
    fsdp, _ = lora_pair
    data = make_sft_data(LENGTHS, seed=22)
    fsdp.forward_backward(data)
    fsdp.optim_step(ADAM)
    fsdp.save_state(tmp_path / "s")
    assert (tmp_path / "s" / "sharded" / ".metadata").is_file()
    assert not (tmp_path / "s" / "model.safetensors").exists()
    before = fsdp.forward(data)
    fsdp.forward_backward(data)
    first = fsdp.optim_step(ADAM).metrics
    fsdp.load_state(tmp_path / "s")
    assert_outputs_close(fsdp.forward(data), before, atol=0)
    fsdp.forward_backward(data)
    again = fsdp.optim_step(ADAM).metrics
    assert again == first  # weights and Adam moments restored exactly
    # a sharded state that does not fit is refused from its metadata, before the ranks load it
    import attrs

    engine = fsdp.engine
    layout = engine.state_layout
    name = next(iter(layout.trainable))
    wrong = attrs.evolve(layout.trainable[name], shape=(3, 3))
    engine.state_layout = attrs.evolve(layout, trainable={**layout.trainable, name: wrong})
    try:
        with pytest.raises(CheckpointError, match=rf"optim.state.{name}.exp_avg: .*expected \[3, 3\]"):
            fsdp.load_state(tmp_path / "s")
        fsdp.load_state(tmp_path / "s", optimizer=False)  # the weights alone still fit
    finally:
        engine.state_layout = layout
    (tmp_path / "s" / "sharded" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="metadata"):
        fsdp.load_state(tmp_path / "s")
    # the sharded format is fsdp-only: the local engine says so instead of loading garbage
    with skyrl_sdk.Backend(model="tiny", lora=LORA) as local:
        with pytest.raises(CheckpointError):
            local.load_state(tmp_path / "s")


def _critic_data(lengths, seed):
    rng = np.random.default_rng(seed)
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(rng.integers(0, 256, n)),
            loss_fn_inputs={
                "values": rng.normal(size=n).astype(np.float32),
                "returns": rng.normal(size=n).astype(np.float32),
                "weights": (rng.random(n) > 0.2).astype(np.float32),
            },
        )
        for n in lengths
    ]


def test_critic_with_default_batching():
    """Several datums per micro-batch (bucket layout, padding) on each rank; ``:mean``
    metrics merged across ranks by their weights; with ``reshard_after_forward=False`` a
    no-grad forward between backward and optim_step leaves no stale gathered weights."""
    cfg = {"world_size": 2, "reshard_after_forward": False}
    fsdp = skyrl_sdk.Backend(model="tiny", role="critic", engine="fsdp", engine_config=cfg)
    local = skyrl_sdk.Backend(model="tiny", role="critic")
    try:
        data = _critic_data(LENGTHS + [14, 2], seed=23)
        for _ in range(2):
            out_f = fsdp.forward_backward(data, "ppo", {"value_clip": 0.1})
            out_l = local.forward_backward(data, "ppo", {"value_clip": 0.1})
            assert "vf_clip_fraction:mean" in out_f.metrics
            assert_metrics_close(out_f.metrics, out_l.metrics)
            assert_outputs_close(out_f, out_l, atol=1e-5)
            # the batching layout differs (padding widths): float32 noise ~3e-6
            assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-5, rtol=1e-5, what="grad")
            assert_outputs_close(fsdp.forward(data, "ppo"), local.forward(data, "ppo"), atol=1e-5)
            m_f, m_l = fsdp.optim_step(ADAM).metrics, local.optim_step(ADAM).metrics
            assert m_f["grad_norm"] == pytest.approx(m_l["grad_norm"], rel=1e-5)
        assert_outputs_close(fsdp.forward(data, "ppo"), local.forward(data, "ppo"), atol=1e-4)
        bare = [types.Datum(model_input=d.model_input, loss_fn_inputs={}) for d in data]  # reads the values
        assert_outputs_close(fsdp.forward(bare), local.forward(bare), atol=1e-4)
    finally:
        fsdp.close()
        local.close()


def _tied_llama(directory) -> str:
    """A small Llama whose lm_head is its input embedding (tie_word_embeddings), saved."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=257, pad_token_id=258)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def test_tied_embeddings(tmp_path):
    """Tied embedding / lm_head: one shared shard; files hold the tensor once, like local's."""
    model = _tied_llama(tmp_path / "tied")
    fsdp = skyrl_sdk.Backend(model=model, engine="fsdp", engine_config={"world_size": 2, **ONE_PER_MICRO_BATCH})
    local = skyrl_sdk.Backend(model=model, engine_config=ONE_PER_MICRO_BATCH)
    try:
        data = make_sft_data(LENGTHS, seed=24)
        fsdp.forward_backward(data)
        local.forward_backward(data)
        assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-6, rtol=1e-6, what="grad")
        fsdp.optim_step(ADAM)
        local.optim_step(ADAM)
        for kind, save in (("state", "save_state"), ("hf", "save_weights_for_sampler")):
            getattr(fsdp, save)(tmp_path / f"f_{kind}")
            getattr(local, save)(tmp_path / f"l_{kind}")
            got = _files(tmp_path / f"f_{kind}" / "model.safetensors")
            assert "lm_head.weight" not in got
            assert_tensors_close(got, _files(tmp_path / f"l_{kind}" / "model.safetensors"), atol=5e-5, what=kind)
        local.load_state(tmp_path / "f_state")
        assert_outputs_close(fsdp.forward(data), local.forward(data), atol=1e-5)
    finally:
        fsdp.close()
        local.close()


def test_lora_on_a_tied_head_exports_the_merged_head_untied(tmp_path):
    """LoRA on the head of a tied model: the merged export writes the adapted head beside the
    embedding and unties them in config.json, as the local engine does (it used to drop the
    head's delta: the head was skipped as the embedding's alias)."""
    import json

    model = _tied_llama(tmp_path / "tied")
    lora = types.LoraConfig(rank=2)
    fsdp = skyrl_sdk.Backend(model=model, lora=lora, engine="fsdp", engine_config={"world_size": 2, **ONE_PER_MICRO_BATCH})
    local = skyrl_sdk.Backend(model=model, lora=lora, engine_config=ONE_PER_MICRO_BATCH)
    try:
        data = make_sft_data(LENGTHS, seed=25)
        for backend in (fsdp, local):
            backend.forward_backward(data)
            backend.optim_step(ADAM)
            backend.save_weights_for_sampler(tmp_path / backend.engine_name)
        got, expected = _files(tmp_path / "fsdp" / "model.safetensors"), _files(tmp_path / "local" / "model.safetensors")
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(got)
        assert not np.array_equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # the delta is in
        assert_tensors_close(got, expected, atol=5e-5, what="merged export")
        for engine in ("fsdp", "local"):
            assert json.loads((tmp_path / engine / "config.json").read_text())["tie_word_embeddings"] is False
    finally:
        fsdp.close()
        local.close()


def test_which_modules_get_fsdp_units_of_their_own(tmp_path):
    """Untied embedding and plain head: units of their own (the root would keep them gathered
    for the whole step); a LoRA-wrapped head, a critic's value head or a tied pair: the root."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from skyrl_sdk.models import hf_model, load_model
    from skyrl_sdk.models.scoring import ScoringModel
    from skyrl_sdk_fsdp.parallelize import untied_embedding_and_head

    def units(model, role="policy", lora=None):
        loaded = load_model(model, role=role, lora=lora)
        scoring = ScoringModel(loaded.module, role)
        embedding, head = untied_embedding_and_head(scoring)
        inner = hf_model(loaded.module)
        return (embedding is inner.get_input_embeddings(),
                head is not None and head is inner.get_output_embeddings())

    assert units("tiny") == (True, True)
    assert units("tiny", lora=LORA) == (True, False)  # train_unembed: peft wraps lm_head
    assert units("tiny", lora=types.LoraConfig(rank=4, train_unembed=False)) == (True, True)
    assert units("tiny", role="critic") == (True, False)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    assert units(str(tmp_path / "tied")) == (False, False)
