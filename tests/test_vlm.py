"""Vision-language models in process: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (tiny, random, built
offline), datums holding Tinker's image chunks.

Checked: the logprobs of every position (the text after an image included) equal
transformers' own model + processor + forward within 1e-4 in float32, whatever the
micro-batching; M-RoPE positions equal the families' ``get_rope_index``; an image takes the
positions tinker-cookbook counts for it; tinker's ImageChunk is taken duck-typed; bad or
oversized images are refused by name before compute, changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import skyrl_sdk
import vlm_helpers
from skyrl_sdk.engines.turns import run_to_end
from skyrl_sdk.errors import DatumError, InputError, ModelLoadError
from skyrl_sdk.models.tiny_vlm import FAMILIES, make_tiny_vlm
from skyrl_sdk.models.vlm import mrope_positions
from skyrl_sdk.testing import around_image_decodes, grads_of
from skyrl_sdk.types import Datum, EncodedTextChunk, ImageChunk, ModelInput
from vlm_helpers import image_input, image_tokens, png, processor, reference_logprobs, sft_datum

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm_dir(request, tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl") / "model", "qwen2_vl")


def _image_data(model_dir, image_token_id: int) -> list[Datum]:
    """Datums with one image, two images (of other sizes) and none; text after each image."""
    proc = processor(model_dir)
    rng = np.random.default_rng(0)

    def text(n):
        return rng.integers(0, 256, n).tolist()

    inputs = [image_input(proc, [text(5), png(60, 40, seed=1), text(7)]),
              image_input(proc, [text(3), png(50, 90, seed=2), text(4), png(60, 40, seed=1), text(6)]),
              image_input(proc, [text(9)])]
    return [sft_datum(mi, image_token_id) for mi in inputs]


@pytest.mark.parametrize("engine_config", [{}, {"micro_batch_tokens": 20}, {"batching": "pack"}],
                         ids=["bucket", "one-per-micro-batch", "pack"])
def test_logprobs_after_images_equal_transformers(vlm_dir, engine_config):
    with skyrl_sdk.Backend(model=str(vlm_dir), engine_config=engine_config) as b:
        data = _image_data(vlm_dir, b.engine.loaded.config.image_token_id)
        ours = [o["logprobs"].to_numpy() for o in b.forward(data, "cross_entropy").loss_fn_outputs]
        info = b.get_info()
    assert info.prefix_sharing.startswith("off: a vision-language model")
    for i, (x, y) in enumerate(zip(ours, reference_logprobs(vlm_dir, data), strict=True)):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0, err_msg=f"datum {i}")


def test_mrope_positions_equal_get_rope_index(vlm_dir):
    from transformers import AutoModel

    with skyrl_sdk.Backend(model=str(vlm_dir)) as b:
        image_id = b.engine.loaded.config.image_token_id
        data = _image_data(vlm_dir, image_id)
        prepared = run_to_end(b.engine.images.prepare_steps([d.model_input for d in data], lambda i, m: DatumError(m, index=i)))
    model = AutoModel.from_pretrained(str(vlm_dir))
    for mi in prepared:
        ids = torch.from_numpy(mi.to_numpy())[None]
        grids = [list(c.grid_thw) for c in mi.images]
        expected, _ = model.get_rope_index(ids, (ids == image_id).int(),
                                           image_grid_thw=torch.tensor(grids) if grids else None)
        np.testing.assert_array_equal(mrope_positions(mi), expected[:, 0].numpy())


def test_image_chunk_takes_the_positions_tinker_cookbook_counts(qwen2_vl_dir):
    import tinker
    from PIL import Image
    from tinker_cookbook.renderers.base import image_to_chunk

    proc = processor(qwen2_vl_dir)
    for size in [(60, 40), (50, 90), (300, 200), (20, 20)]:
        chunk = image_to_chunk(Image.new("RGB", size, (10, 200, 30)), proc)  # JPEG, expected_tokens set
        theirs = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[1, 2]), chunk])
        ours = skyrl_sdk.types.Datum(model_input=theirs).model_input
        assert isinstance(ours.chunks[1], ImageChunk) and ours.length == theirs.length
        with skyrl_sdk.Backend(model=str(qwen2_vl_dir)) as b:
            assert b.engine.images.count_tokens(*size) == chunk.expected_tokens
            prepared = run_to_end(b.engine.images.prepare_steps([ours], lambda i, m: DatumError(m, index=i)))[0]
        assert prepared.length == theirs.length and len(prepared.to_numpy()) == theirs.length
    import sys

    assert "torchvision" not in sys.modules  # the PIL processor: torchvision is never imported


def test_tinker_datums_duck_typed_score_as_ours(qwen2_vl_dir):
    import tinker

    with skyrl_sdk.Backend(model=str(qwen2_vl_dir)) as b:
        data = _image_data(qwen2_vl_dir, b.engine.loaded.config.image_token_id)[:2]
        theirs = []
        for d in data:
            chunks = [tinker.EncodedTextChunk(tokens=c.tokens.tolist()) if isinstance(c, EncodedTextChunk)
                      else tinker.types.ImageChunk(data=c.data, format=c.format, expected_tokens=c.expected_tokens)
                      for c in d.model_input.chunks]
            theirs.append(tinker.Datum(model_input=tinker.ModelInput(chunks=chunks), loss_fn_inputs={
                k: tinker.TensorData.from_numpy(v.to_numpy()) for k, v in d.loss_fn_inputs.items()}))
        ours = b.forward(data, "cross_entropy").loss_fn_outputs
        duck = b.forward(theirs, "cross_entropy").loss_fn_outputs
    for x, y in zip(ours, duck, strict=True):
        np.testing.assert_array_equal(x["logprobs"].to_numpy(), y["logprobs"].to_numpy())


def test_expected_tokens_may_be_left_to_the_server(qwen2_vl_dir):
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir)) as b:
        image_id = b.engine.loaded.config.image_token_id
        datum = _image_data(qwen2_vl_dir, image_id)[0]
        counted = ModelInput([c if isinstance(c, EncodedTextChunk) else ImageChunk(c.data, "png")
                              for c in datum.model_input.chunks])
        with pytest.raises(InputError, match="expected_tokens is not set"):
            _ = counted.length
        same = Datum(model_input=counted, loss_fn_inputs=datum.loss_fn_inputs)
        a, c = b.forward([datum, same], "cross_entropy").loss_fn_outputs
    np.testing.assert_array_equal(a["logprobs"].to_numpy(), c["logprobs"].to_numpy())


def _one_image_datum(model_dir, image: bytes, fmt: str = "png", expected: int | None = None) -> Datum:
    proc = processor(model_dir)
    n = image_tokens(proc, image) if expected is None and fmt == "png" else expected
    mi = ModelInput([EncodedTextChunk([1, 2]), ImageChunk(image, fmt, n), EncodedTextChunk([3])])
    length = 3 + (n or image_tokens(proc, image))
    return Datum(model_input=mi, loss_fn_inputs={"target_tokens": np.ones(length, np.int64),
                                                 "weights": np.ones(length, np.float32)})


@pytest.mark.parametrize("case,match", [
    ("count", r"datum 1: model_input.chunks\[1\]: expected_tokens is 5, but this model's image processor makes "
              r"the 60x40 image 2 tokens"),
    ("format", r"datum 1: model_input.chunks\[1\]: format is 'jpeg' but the data is a PNG image"),
    ("bytes", r"datum 1: model_input.chunks\[1\]: the data is not a PNG or JPEG image"),
    ("pixels", r"datum 1: model_input.chunks\[1\]: the image is 300x200 = 60000 pixels, over the limit of 50000 "
               r"pixels per image \(max_image_pixels\)"),
    ("datum_tokens", r"datum 1: its images take 16 positions, over the limit of 10 image tokens per datum "
                     r"\(max_image_tokens_per_datum\)"),
    ("call_tokens", r"the images of this call take 18 positions, over the limit of 17 image tokens per call "
                    r"\(max_image_tokens_per_call\)"),
])
def test_bad_or_oversized_images_are_refused_before_compute(qwen2_vl_dir, case, match):
    config = {"max_image_pixels": 50_000, "max_image_tokens_per_datum": 10, "max_image_tokens_per_call": 17}
    good = _one_image_datum(qwen2_vl_dir, png(60, 40, seed=1))
    bad = {
        "count": lambda: _one_image_datum(qwen2_vl_dir, png(60, 40, seed=1), expected=5),
        "format": lambda: _one_image_datum(qwen2_vl_dir, png(60, 40, seed=1), fmt="jpeg", expected=2),
        "bytes": lambda: _one_image_datum(qwen2_vl_dir, b"\x89PNG not really", expected=2),
        "pixels": lambda: _one_image_datum(qwen2_vl_dir, png(300, 200, seed=3)),
        "datum_tokens": lambda: _one_image_datum(qwen2_vl_dir, png(112, 112, seed=3)),
        "call_tokens": lambda: _one_image_datum(qwen2_vl_dir, png(56, 112, seed=3)),
    }[case]()
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir), lora={"rank": 2}, engine_config=config) as b:
        decoded = []
        with around_image_decodes(lambda decode: decoded.append(1) or decode()), \
                pytest.raises(InputError, match=match):
            b.forward_backward([good, bad] + ([bad] if case == "call_tokens" else []), "cross_entropy")
        assert decoded == [] and not b.engine.runner.has_pending_grads()  # nothing decoded, no gradient
        b.forward_backward([good], "cross_entropy")  # the Backend still works


def _image_call(model_dir, images: list[tuple[bytes, str]]) -> Datum:
    """One datum holding ``images`` ((bytes, format) each) between tokens."""
    proc = processor(model_dir)
    chunks = [EncodedTextChunk([1, 2])]
    for data, fmt in images:
        chunks += [ImageChunk(data, fmt, image_tokens(proc, data)), EncodedTextChunk([3])]
    mi = ModelInput(chunks)
    return Datum(model_input=mi, loss_fn_inputs={"target_tokens": np.ones(mi.length, np.int64),
                                                 "weights": np.ones(mi.length, np.float32)})


@pytest.mark.parametrize("case,match", [
    ("scans", r"datum 0: model_input.chunks\[1\]: the JPEG has 4\d scans, over the limit of 32 scans per image "
              r"\(max_jpeg_scans"),
    ("call_pixels", r"the 3 distinct images of this call are 7200 pixels together, over the limit of 5000 decoded "
                    r"pixels per call \(max_image_pixels_per_call\)"),
])
def test_decoding_work_is_bounded_before_anything_is_decoded(qwen2_vl_dir, case, match):
    """Issue 41, items 2 and 3. Before: a progressive JPEG repeating its last scan (a pass over
    every pixel each: 600 of them on 4096x4096, 115 KB, took 13 s on the one compute thread) was
    decoded, and the limits bounded image positions, not pixels (16 distinct 4096x4096 PNGs
    in a datum took 6.7 s; 4096 such images per request were allowed). Now a JPEG's scans and
    the pixels of a call's distinct images are counted from the headers first."""
    from vlm_helpers import progressive_jpeg

    images = {"scans": [(progressive_jpeg(64, 48, repeat_last_scan=35), "jpeg")],
              "call_pixels": [(png(60, 40, seed=s), "png") for s in (1, 2, 3)]}[case]
    config = {"max_image_pixels_per_call": 5000} if case == "call_pixels" else {}
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir), lora={"rank": 2}, engine_config=config) as b:
        decoded = []
        with around_image_decodes(lambda decode: decoded.append(1) or decode()):
            with pytest.raises(InputError, match=match):
                b.forward([_image_call(qwen2_vl_dir, images)], "cross_entropy")
            assert decoded == []
            # within the limits: 10 scans; the same image three times is one decode of 2400 pixels
            b.forward([_image_call(qwen2_vl_dir, [(progressive_jpeg(64, 48), "jpeg")])], "cross_entropy")
            b.forward([_image_call(qwen2_vl_dir, [(png(60, 40, seed=1), "png")] * 3)], "cross_entropy")
        assert decoded == [1, 1]
    assert progressive_jpeg(64, 48).count(b"\xff\xda") == 10


def test_an_image_past_its_decoding_time_fails_the_call_by_name(qwen2_vl_dir):
    """Issue 41, item 2: a time budget per image, checked as the bytes are fed to the decoder
    (a budget no decoder can meet: the refusal does not depend on this machine's speed)."""
    datum = _image_call(qwen2_vl_dir, [(png(60, 40, seed=1), "png")])
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir), lora={"rank": 2},
                           engine_config={"max_image_decode_s": 1e-9}) as b:
        with pytest.raises(InputError, match=r"datum 0: model_input.chunks\[1\]: decoding the image took more than "
                                             r"1e-09 s, the limit per image \(max_image_decode_s\)"):
            b.forward([datum], "cross_entropy")
    with pytest.raises(InputError, match=r"engine_config\['max_image_decode_s'\]: expected a value > 0.0, got 0.0"):
        skyrl_sdk.Backend(model=str(qwen2_vl_dir), engine_config={"max_image_decode_s": 0})


def test_a_call_gives_way_between_its_images(qwen2_vl_dir):
    """Issue 41, item 3: between two decodes the stepped call pauses (yields), where the
    server's compute thread gives other clients their turns (as between micro-batches)."""
    order = []
    datum = _image_call(qwen2_vl_dir, [(png(60, 40, seed=s), "png") for s in (1, 2, 1, 3)])
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir), lora={"rank": 2}) as b:
        with around_image_decodes(lambda decode: order.append("decode") or decode()):
            steps = b.forward_steps([datum], "cross_entropy")
            for _ in steps:  # the call pauses here: the server's compute thread gives others their turns
                order.append("turn")
    assert order == ["decode", "turn", "decode", "turn", "decode"]  # 3 distinct images, one micro-batch


def test_images_refused_by_name_where_not_read(qwen2_vl_dir):
    import tinker

    datum = _one_image_datum(qwen2_vl_dir, png(60, 40, seed=1))
    with skyrl_sdk.Backend(model="tiny") as b:
        with pytest.raises(DatumError, match="datum 0: model_input holds an image, but model 'tiny' reads no images"):
            b.forward([datum], "cross_entropy")
        with pytest.raises(InputError, match="prompt 1: model_input holds an image"):
            b.sample([[1, 2], datum.model_input], {"max_tokens": 2})
    pointer = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[1]), tinker.types.ImageAssetPointerChunk(
        format="png", location="/etc/passwd", expected_tokens=4)])
    with pytest.raises(InputError, match=r"chunks\[1\]: 'image_asset_pointer' chunks are not served"):
        Datum(model_input=pointer)
    with pytest.raises(InputError, match="image chunk format: expected one of"):
        ImageChunk(b"x", "gif")
    with pytest.raises(InputError, match="expected_tokens: expected a positive integer"):
        ImageChunk(b"x", "png", 0)


def test_other_vision_language_families_are_refused_by_name(tmp_path):
    from transformers import LlavaConfig

    LlavaConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'llava' is a vision-language model skyrl-sdk does not support"):
        skyrl_sdk.Backend(model=str(tmp_path))


# ---- what a newcomer needs: counting an image, making a tiny model, the targets at image positions ---------
def test_image_tokens_is_the_public_count_of_an_images_positions(qwen2_vl_dir):
    """``Backend.image_tokens`` equals tinker-cookbook's count for the same image, from bytes, a
    chunk (ours or tinker's) or a size, checks the image as a call would, and a text model refuses."""
    import tinker
    from PIL import Image
    from tinker_cookbook.renderers.base import image_to_chunk

    proc = processor(qwen2_vl_dir)
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir)) as b:
        for size in [(60, 40), (50, 90), (300, 200)]:
            theirs = image_to_chunk(Image.new("RGB", size, (10, 200, 30)), proc)
            data = png(*size, seed=3)
            assert b.image_tokens(data) == b.image_tokens(ImageChunk(data, "png")) == b.image_tokens(size) \
                == b.image_tokens(theirs) == theirs.expected_tokens
            assert ModelInput([ImageChunk(data, "png", b.image_tokens(data))]).length == theirs.expected_tokens
        for bad, match in [(b"GIF89a....", "not a PNG or JPEG"), ((0, 5), "two positive integers"),
                           ("a.png", "expected an ImageChunk")]:
            with pytest.raises(InputError, match=match):
                b.image_tokens(bad)
        with pytest.raises(InputError, match="image: the image is 5000x5000 = 25000000 pixels, over the limit"):
            b.image_tokens(png(5000, 5000))
    with skyrl_sdk.Backend(model="tiny") as text, pytest.raises(InputError, match="'tiny' reads no images"):
        text.image_tokens((60, 40))
    assert tinker  # the duck-typed chunk above is the tinker client's


def test_targets_at_image_positions_do_not_matter_at_weight_zero(qwen2_vl_dir):
    """docs/backend.md: at an image position (but its last) nothing is predicted; any target id
    there (tinker-cookbook sends 0) gives the same loss and gradient when its weight is 0."""
    proc = processor(qwen2_vl_dir)
    with skyrl_sdk.Backend(model=str(qwen2_vl_dir)) as b:
        image_id = b.engine.loaded.config.image_token_id
        mi = image_input(proc, [[1, 2, 3], png(60, 40, seed=1), [4, 5, 6, 7]])
        ids = np.asarray(vlm_helpers.expanded_ids(mi, image_id)[1:] + [8])
        in_image = np.asarray(vlm_helpers.expanded_ids(mi, image_id)[1:] + [8]) == image_id
        weights = (~in_image).astype(np.float32)
        results = []
        for fill in (0, image_id, 77):
            targets = np.where(in_image, fill, ids)
            out = b.forward_backward([Datum(model_input=mi, loss_fn_inputs={"target_tokens": targets,
                                                                            "weights": weights})], "cross_entropy")
            grads = {k: v.clone() for k, v in grads_of(b).items()}
            b.zero_grad()
            results.append((out.metrics["loss:sum"], grads))
    assert results[0][0] == results[1][0] == results[2][0] and results[0][1]
    for _, grads in results[1:]:
        assert all(torch.equal(grads[k], results[0][1][k]) for k in grads)


def test_make_tiny_vlm_needs_pillow_not_pytest_and_writes_whole_or_nothing(tmp_path, monkeypatch):
    import subprocess
    import sys

    # importable and usable without pytest
    script = ("import sys; sys.modules['pytest'] = None; from skyrl_sdk.models.tiny_vlm import make_tiny_vlm; "
              f"print(make_tiny_vlm({str(tmp_path / 'nopytest')!r}, 'qwen2_vl'))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "nopytest" / "preprocessor_config.json").is_file()
    # without Pillow: refused by name before anything is written
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ModelLoadError, match=r"make_tiny_vlm needs Pillow .*pip install -e \".\[vision\]\""):
        make_tiny_vlm(tmp_path / "nopil", "qwen2_vl")
    assert not (tmp_path / "nopil").exists()
    monkeypatch.delitem(sys.modules, "PIL")
    # a failure half way leaves no directory behind (nor a temporary one)
    import skyrl_sdk.models.tiny_vlm as tiny_vlm

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tiny_vlm, "tiny_vlm_tokenizer", lambda: type("T", (), {"save_pretrained": broken})())
    with pytest.raises(Exception, match="disk full"):
        make_tiny_vlm(tmp_path / "half", "qwen2_vl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nopytest"]
