"""Images, image datums and transformers' own reference for the vision-language tests
(shared by test_vlm.py and test_server_vlm.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from skyrl_sdk.models.tiny_vlm import TOKEN_IDS
from skyrl_sdk.types import Datum, EncodedTextChunk, ImageChunk, ModelInput

IM_START, IM_END = TOKEN_IDS["<|im_start|>"], TOKEN_IDS["<|im_end|>"]
VISION_START, VISION_END = TOKEN_IDS["<|vision_start|>"], TOKEN_IDS["<|vision_end|>"]


def png(width: int, height: int, seed: int = 0, color: tuple[int, int, int] | None = None) -> bytes:
    """A PNG of random pixels (or one colour)."""
    from PIL import Image

    if color is not None:
        image = Image.new("RGB", (width, height), color)
    else:
        image = Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def progressive_jpeg(width: int, height: int, repeat_last_scan: int = 0) -> bytes:
    """A progressive JPEG (about 10 scans) whose last scan is repeated ``repeat_last_scan`` more
    times: each repeat is one more pass of the decoder over every pixel, in a few bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(buf, format="JPEG", progressive=True, quality=50)
    data = buf.getvalue()
    last = data.rfind(b"\xff\xda")
    return data[:-2] + data[last:-2] * repeat_last_scan + b"\xff\xd9"


def processor(model_dir: str | Path):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")


def image_tokens(proc, data: bytes) -> int:
    """Tinker's count of an image's positions, as tinker-cookbook's ``image_to_chunk`` computes it."""
    from PIL import Image

    width, height = Image.open(io.BytesIO(data)).size
    return proc.get_number_of_image_patches(height, width, images_kwargs={}) // proc.merge_size**2


def image_input(proc, parts: list) -> ModelInput:
    """A ModelInput of token lists and PNG bytes, in order (images counted as Tinker counts them)."""
    chunks = [EncodedTextChunk(p) if isinstance(p, list) else ImageChunk(p, "png", image_tokens(proc, p))
              for p in parts]
    return ModelInput(chunks)


def expanded_ids(model_input: ModelInput, image_token_id: int) -> list[int]:
    ids: list[int] = []
    for c in model_input.chunks:
        ids += c.tokens.tolist() if isinstance(c, EncodedTextChunk) else [image_token_id] * c.length
    return ids


def sft_datum(model_input: ModelInput, image_token_id: int, next_token: int = 1) -> Datum:
    """Every position predicts the next id of the expanded sequence (the last: ``next_token``)."""
    ids = expanded_ids(model_input, image_token_id)
    targets = np.asarray(ids[1:] + [next_token], dtype=np.int64)
    return Datum(model_input=model_input,
                 loss_fn_inputs={"target_tokens": targets, "weights": np.ones(len(ids), np.float32)})


def reference_logprobs(model_dir: str | Path, data: list[Datum]) -> list[np.ndarray]:
    """transformers' own model, processor and forward, one datum at a time (no skyrl-sdk code):
    log_softmax of the logits at each datum's targets."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    proc = processor(model_dir)
    image_id = model.config.image_token_id
    out = []
    for d in data:
        ids = expanded_ids(d.model_input, image_id)
        images = [Image.open(io.BytesIO(c.data)).convert("RGB") for c in d.model_input.chunks
                  if isinstance(c, ImageChunk)]
        kwargs = {"mm_token_type_ids": torch.tensor([[int(t == image_id) for t in ids]])}
        if images:
            batch = proc(images=images, return_tensors="pt")
            kwargs.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float()
        targets = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
        out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy())
    return out


def classifier_datum(proc, image: bytes, label: str) -> tuple[ModelInput, Datum]:
    """A chat turn ``<|im_start|>user <image><|im_end|> <|im_start|>assistant label<|im_end|>``:
    the prompt, and the datum that trains the label (weights on the answer only)."""
    prompt = image_input(proc, [[IM_START, *b"user\n", VISION_START], image,
                                [VISION_END, IM_END, 10, IM_START, *b"assistant\n"]])
    answer = [*label.encode(), IM_END]
    model_input = ModelInput([*prompt.chunks, EncodedTextChunk(answer[:-1])])
    n = model_input.length
    ids = expanded_ids(model_input, 0) + [answer[-1]]
    weights = np.zeros(n, np.float32)
    weights[-len(answer):] = 1.0
    return prompt, Datum(model_input=model_input, loss_fn_inputs={
        "target_tokens": np.asarray(ids[1:], dtype=np.int64), "weights": weights})
