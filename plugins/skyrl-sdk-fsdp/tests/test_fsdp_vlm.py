"""A vision-language model (tiny random Qwen2-VL) under FSDP on 2 CPU ranks: image datums
train with LoRA exactly as on the local engine (outputs, gradients, steps), the vision tower
stays frozen, sampling from an image prompt draws what the local engine draws, and the merged
export carries the image processor."""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("skyrl_sdk_fsdp")
pytest.importorskip("peft")

from fsdp_testutil import ONE_PER_MICRO_BATCH

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.models.tiny_vlm import make_tiny_vlm
from skyrl_sdk.testing import assert_metrics_close, assert_outputs_close, assert_tensors_close, grads_of, torch_threads

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LORA = types.LoraConfig(rank=4, alpha=16.0)
ADAM = types.AdamParams(learning_rate=1e-2, grad_clip_norm=20.0)


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _image_input(backend, text: list[list[int]], images: list[bytes]) -> types.ModelInput:
    chunks = []
    for i, tokens in enumerate(text):
        chunks.append(types.EncodedTextChunk(tokens))
        if i < len(images):
            from PIL import Image

            size = Image.open(io.BytesIO(images[i])).size
            chunks.append(types.ImageChunk(images[i], "png", backend.engine.images.count_tokens(*size)))
    return types.ModelInput(chunks)


def _data(backend) -> list[types.Datum]:
    rng = np.random.default_rng(3)
    inputs = [_image_input(backend, [rng.integers(0, 256, 5).tolist(), rng.integers(0, 256, 7).tolist()],
                           [_png(60, 40, 1)]),
              _image_input(backend, [rng.integers(0, 256, 3).tolist(), [9, 8], rng.integers(0, 256, 4).tolist()],
                           [_png(50, 90, 2), _png(60, 40, 1)]),
              _image_input(backend, [rng.integers(0, 256, 11).tolist()], [])]
    data = []
    for mi in inputs:
        n = mi.length
        targets = rng.integers(0, 256, n)
        data.append(types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": targets,
                                                                "weights": np.ones(n, np.float32)}))
    return data


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = str(make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", "qwen2_vl"))
    with torch_threads(1):
        fsdp = skyrl_sdk.Backend(model=model, engine="fsdp", lora=LORA,
                                 engine_config={"world_size": 2, **ONE_PER_MICRO_BATCH})
        local = skyrl_sdk.Backend(model=model, lora=LORA, engine_config=ONE_PER_MICRO_BATCH)
        yield fsdp, local
        fsdp.close()
        local.close()


def test_image_datums_train_as_on_the_local_engine(pair, tmp_path):
    fsdp, local = pair
    assert fsdp.get_info().num_trainable_parameters == local.get_info().num_trainable_parameters
    data = _data(local)
    for step in range(2):
        out_f, out_l = fsdp.forward_backward(data), local.forward_backward(data)
        assert_metrics_close(out_f.metrics, out_l.metrics)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        grads = fsdp.engine.gradients()
        assert grads and not [n for n in grads if ".visual." in n]  # the vision tower has no adapter
        tol = 1e-6 if step == 0 else 1e-5
        assert_tensors_close(grads, grads_of(local), atol=tol, rtol=tol, what=f"grad@{step}")
        fsdp.optim_step(ADAM)
        local.optim_step(ADAM)
    prompt = data[0].model_input
    greedy = {"max_tokens": 6, "temperature": 0.0}
    sampled_f, sampled_l = fsdp.sample([prompt], greedy), local.sample([prompt], greedy)
    assert sampled_f[0].sequences[0].tokens == sampled_l[0].sequences[0].tokens
    np.testing.assert_allclose(sampled_f[0].sequences[0].logprobs, sampled_l[0].sequences[0].logprobs, atol=1e-4)
    fsdp.save_weights_for_sampler(tmp_path / "export")
    assert (tmp_path / "export" / "preprocessor_config.json").is_file()
    with skyrl_sdk.Backend(model=str(tmp_path / "export")) as exported:
        assert_outputs_close(exported.forward(data), local.forward(data), atol=5e-5)
