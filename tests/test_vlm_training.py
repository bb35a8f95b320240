"""Vision-language models trained, sampled and used as critics, in process.

LoRA goes on the language model only (the vision tower stays frozen unless asked) and
learns a two-colour toy; sampling from an image prompt draws what transformers' own
``generate`` draws, with the logprobs ``forward`` gives; a critic scores image datums as
transformers' backbone plus its value head; an adapter on a shared base scores as a
Backend of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk.models.loading import lora_targets
from skyrl_sdk.models.tiny_vlm import TOKEN_IDS, make_tiny_vlm
from skyrl_sdk.types import Datum, EncodedTextChunk, LoraConfig, ModelInput
from vlm_helpers import classifier_datum, expanded_ids, image_input, png, processor, reference_logprobs, sft_datum

RED, BLUE = png(56, 56, color=(220, 30, 30)), png(56, 56, color=(30, 30, 220))
IMAGE_PAD = TOKEN_IDS["<|image_pad|>"]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl") / "model", "qwen2_vl")


def _tower(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if ".visual." in n}


def test_vision_tower_frozen_by_default_and_trained_when_asked(vlm_dir):
    with skyrl_sdk.Backend(model=str(vlm_dir), lora={"rank": 4}) as b:
        module = b.engine.loaded.module
        lora_layers = [n for n, _ in module.named_modules() if n.endswith("lora_A")]
        assert lora_layers and not [n for n in lora_layers if ".visual." in n]
        assert all(".language_model." in n or ".lm_head." in n for n in lora_layers)
    with skyrl_sdk.Backend(model=str(vlm_dir), lora={"rank": 4}, engine_config={"train_vision_tower": True}) as b:
        module = b.engine.loaded.module
        assert [n for n, _ in module.named_modules() if n.endswith("lora_A") and ".visual." in n]
    with skyrl_sdk.Backend(model=str(vlm_dir)) as b:  # full fine-tuning: the tower's weights do not train
        trainable = {n for n, p in b.engine.loaded.module.named_parameters() if p.requires_grad}
        assert trainable and not [n for n in trainable if ".visual." in n]
        assert b.get_info().num_trainable_parameters < b.get_info().num_parameters
    with skyrl_sdk.Backend(model=str(vlm_dir), engine_config={"train_vision_tower": True}) as b:
        assert b.get_info().num_trainable_parameters == b.get_info().num_parameters
        assert [n for n in lora_targets(b.engine.loaded.module, LoraConfig(rank=1), True) if ".visual." in n]


def test_lora_learns_both_colours(vlm_dir):
    proc = processor(vlm_dir)
    (red_prompt, red), (blue_prompt, blue) = classifier_datum(proc, RED, "red"), classifier_datum(proc, BLUE, "blue")
    _, red_as_blue = classifier_datum(proc, RED, "blue")
    _, blue_as_red = classifier_datum(proc, BLUE, "red")
    with skyrl_sdk.Backend(model=str(vlm_dir), lora={"rank": 8}, seed=0) as b:
        tower = _tower(b.engine.loaded.module)
        for _ in range(60):
            b.forward_backward([red, blue], "cross_entropy")
            b.optim_step({"learning_rate": 1e-2, "grad_clip_norm": 1.0})
        outputs = b.forward([red, blue, red_as_blue, blue_as_red], "cross_entropy").loss_fn_outputs
        nll = [-(o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
               for o, d in zip(outputs, [red, blue, red_as_blue, blue_as_red], strict=True)]
        samples = b.sample([red_prompt, blue_prompt], {"max_tokens": 8, "temperature": 0.0})
        after = _tower(b.engine.loaded.module)
    assert nll[0] < 0.1 and nll[1] < 0.1 and nll[2] > 5 and nll[3] > 5, nll
    answers = [bytes(t for t in s.sequences[0].tokens if t < 256) for s in samples]
    assert answers == [b"red", b"blue"]
    assert all(torch.equal(tower[n], after[n]) for n in tower)  # the vision tower did not move


def _prompts(vlm_dir) -> list[ModelInput]:
    proc = processor(vlm_dir)
    return [image_input(proc, [[257, 117, 10, 259], png(60, 40, seed=1), [260, 65, 66, 10]]),
            image_input(proc, [[257, 117], png(50, 90, seed=2), [260, 65, 66, 10]])]


def test_sampling_from_image_prompts_matches_transformers(vlm_dir):
    import io

    from PIL import Image
    from transformers import AutoModelForImageTextToText

    prompts = _prompts(vlm_dir)
    ref = AutoModelForImageTextToText.from_pretrained(str(vlm_dir), dtype=torch.float32).eval()
    proc = processor(vlm_dir)
    expected = []
    for p in prompts:
        ids = expanded_ids(p, ref.config.image_token_id)
        batch = proc(images=[Image.open(io.BytesIO(p.images[0].data)).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            out = ref.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               mm_token_type_ids=torch.tensor([[int(t == ref.config.image_token_id) for t in ids]]),
                               pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                               max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    with skyrl_sdk.Backend(model=str(vlm_dir)) as b:
        greedy = b.sample([prompts[0], [1, 2, 3], prompts[1]], {"max_tokens": 10, "temperature": 0.0, "stop": []},
                          num_samples=2, prompt_logprobs=True)
        drawn = b.sample(prompts, {"max_tokens": 6, "seed": 3}, num_samples=3)
        rows = [(p, s) for p, out in zip(prompts, drawn, strict=True) for s in out.sequences]
        data = [sft_datum(ModelInput([*p.chunks, EncodedTextChunk(s.tokens[:-1])]), 0, s.tokens[-1]) for p, s in rows]
        scored = b.forward(data, "cross_entropy").loss_fn_outputs
    for out, want in zip([greedy[0], greedy[2]], expected, strict=True):
        assert [s.tokens for s in out.sequences] == [want, want]
    for (_, s), o in zip(rows, scored, strict=True):  # the sampler's logprobs are forward's
        np.testing.assert_allclose(o["logprobs"].to_numpy()[-len(s.tokens):], s.logprobs, atol=1e-4, rtol=0)
    reference = reference_logprobs(vlm_dir, [sft_datum(prompts[0], IMAGE_PAD)])[0]
    np.testing.assert_allclose(greedy[0].prompt_logprobs[1:], reference[:-1], atol=1e-4, rtol=0)


def test_bfloat16_sampling_from_image_prompts_reports_forward_logprobs(vlm_dir):
    prompts = _prompts(vlm_dir)
    with skyrl_sdk.Backend(model=str(vlm_dir), engine_config={"dtype": "bfloat16"}) as b:
        out = b.sample(prompts, {"max_tokens": 5, "seed": 1}, num_samples=2)
        rows = [(p, s) for p, o in zip(prompts, out, strict=True) for s in o.sequences]
        data = [sft_datum(ModelInput([*p.chunks, EncodedTextChunk(s.tokens[:-1])]), 0, s.tokens[-1]) for p, s in rows]
        scored = b.forward(data, "cross_entropy").loss_fn_outputs
    for (_, s), o in zip(rows, scored, strict=True):  # rescored as forward scores, images included
        np.testing.assert_allclose(o["logprobs"].to_numpy()[-len(s.tokens):], s.logprobs, atol=1e-5, rtol=0)


def test_critic_scores_image_datums_as_transformers_backbone(vlm_dir):
    import io

    from PIL import Image
    from transformers import AutoModel

    prompt = _prompts(vlm_dir)[0]
    n = prompt.length
    datum = Datum(model_input=prompt, loss_fn_inputs={"values": np.zeros(n, np.float32),
                                                      "returns": np.ones(n, np.float32)})
    with skyrl_sdk.Backend(model=str(vlm_dir), role="critic") as c:
        values = c.forward([datum], "value").loss_fn_outputs[0]["values"].to_numpy()
        head = c.engine.loaded.module.value_head
        weight, bias = head.weight.detach().clone(), head.bias.detach().clone()
        c.forward_backward([datum], "value")
        c.optim_step({"learning_rate": 1e-3})
        moved = c.forward([datum], "value").loss_fn_outputs[0]["values"].to_numpy()
    backbone = AutoModel.from_pretrained(str(vlm_dir)).eval()
    ids = expanded_ids(prompt, backbone.config.image_token_id)
    batch = processor(vlm_dir)(images=[Image.open(io.BytesIO(prompt.images[0].data)).convert("RGB")],
                               return_tensors="pt")
    with torch.no_grad():
        hidden = backbone(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"],
                          image_grid_thw=batch["image_grid_thw"],
                          mm_token_type_ids=torch.tensor([[int(t == backbone.config.image_token_id) for t in ids]]),
                          ).last_hidden_state[0]
    np.testing.assert_allclose(values, (hidden @ weight.T + bias)[:, 0].numpy(), atol=1e-4, rtol=0)
    assert np.abs(moved - values).max() > 1e-4  # the critic trains on image datums


def test_adapter_on_a_shared_vlm_base_scores_as_its_own_backend(vlm_dir):
    data = [sft_datum(p, IMAGE_PAD) for p in _prompts(vlm_dir)]
    lora = {"rank": 4, "seed": 5}
    with skyrl_sdk.Backend(model=str(vlm_dir), lora=lora) as own:
        own.forward_backward(data, "cross_entropy")
        own.optim_step({"learning_rate": 1e-2})
        want = [o["logprobs"].to_numpy() for o in own.forward(data, "cross_entropy").loss_fn_outputs]
    with skyrl_sdk.SharedBase(str(vlm_dir)) as base, base.backend(lora) as b:
        b.forward_backward(data, "cross_entropy")
        b.optim_step({"learning_rate": 1e-2})
        got = [o["logprobs"].to_numpy() for o in b.forward(data, "cross_entropy").loss_fn_outputs]
        sampled = b.sample(_prompts(vlm_dir)[:1], {"max_tokens": 3, "temperature": 0.0})
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)
    assert len(sampled[0].sequences[0].tokens) == 3


def test_merged_export_loads_back_as_the_same_vision_language_model(vlm_dir, tmp_path):
    data = [sft_datum(p, IMAGE_PAD) for p in _prompts(vlm_dir)]
    with skyrl_sdk.Backend(model=str(vlm_dir), lora={"rank": 4}) as b:
        b.forward_backward(data, "cross_entropy")
        b.optim_step({"learning_rate": 1e-2})
        want = [o["logprobs"].to_numpy() for o in b.forward(data, "cross_entropy").loss_fn_outputs]
        path = b.save_weights_for_sampler(tmp_path / "export").path
    assert (tmp_path / "export" / "preprocessor_config.json").is_file()  # the same image token counts
    with skyrl_sdk.Backend(model=path) as exported:
        got = [o["logprobs"].to_numpy() for o in exported.forward(data, "cross_entropy").loss_fn_outputs]
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_gradients_do_not_depend_on_the_micro_batching(vlm_dir):
    from skyrl_sdk.testing import assert_tensors_close, grads_of

    proc = processor(vlm_dir)
    data = [sft_datum(p, IMAGE_PAD) for p in _prompts(vlm_dir)]
    data.append(sft_datum(image_input(proc, [[1, 2, 3], png(84, 56, seed=4), [4], png(60, 40, seed=1), [5, 6]]),
                          IMAGE_PAD))
    grads = []
    for config in ({}, {"micro_batch_tokens": 1}, {"batching": "pack"}):
        with skyrl_sdk.Backend(model=str(vlm_dir), lora={"rank": 4}, engine_config=config) as b:
            b.forward_backward(data, "cross_entropy")
            grads.append(grads_of(b))
    for other in grads[1:]:
        assert_tensors_close(other, grads[0], atol=1e-5, rtol=1e-4, what="LoRA gradients")
