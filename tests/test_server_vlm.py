"""Vision-language models through ``skyrl-sdk serve`` and the unmodified ``tinker`` client: a
tiny random Qwen2-VL (built offline) served, datums with Tinker's image chunks (protobuf
forward_backward, JSON sampling) scored as transformers scores them, trained, sampled from,
and oversized or unserved images refused by name; and tinker-cookbook's ``vlm_classifier``
recipe (its dataset, renderer, evaluator and the supervised loop) run against it.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _server_harness import API_KEY, ServerThread
from skyrl_sdk import types
from skyrl_sdk.models.tiny_vlm import TOKEN_IDS, make_tiny_vlm
from vlm_helpers import classifier_datum, expanded_ids, image_tokens, png, processor, reference_logprobs

IMAGE_PAD = TOKEN_IDS["<|image_pad|>"]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl") / "model", "qwen2_vl")


@pytest.fixture(scope="module")
def srv(vlm_dir, tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state"), models=[str(vlm_dir)]) as server:
        yield server


@pytest.fixture(scope="module")
def service(srv):
    client = srv.service_client()
    yield client
    client.close("success").result()


def _theirs(datum: types.Datum) -> tt.Datum:
    """Our datum as the tinker client's (its own ImageChunk, the bytes as they are)."""
    chunks = [tt.EncodedTextChunk(tokens=c.tokens.tolist()) if isinstance(c, types.EncodedTextChunk)
              else tt.ImageChunk(data=c.data, format=c.format, expected_tokens=c.expected_tokens)
              for c in datum.model_input.chunks]
    return tt.Datum(model_input=tt.ModelInput(chunks=chunks), loss_fn_inputs={
        k: tt.TensorData.from_numpy(v.to_numpy()) for k, v in datum.loss_fn_inputs.items()})


def _prompt(model_input: types.ModelInput) -> tt.ModelInput:
    return _theirs(types.Datum(model_input=model_input)).model_input


def test_served_vlm_scores_image_datums_as_transformers(srv, service, vlm_dir):
    import threading

    from PIL import Image
    from tinker_cookbook.renderers.base import image_to_chunk

    from skyrl_sdk.testing import around_image_decodes

    decoded_on = []

    def recording(decode):
        decoded_on.append(threading.current_thread().name)
        return decode()

    proc = processor(vlm_dir)
    capabilities = tinker.RestClient(base_url=srv.url, api_key=API_KEY).get_server_capabilities().result()
    assert str(vlm_dir) in {m.model_name for m in capabilities.supported_models}
    jpeg = image_to_chunk(Image.new("RGB", (70, 50), (200, 120, 10)), proc)  # the cookbook's chunk (JPEG)
    inputs = [
        types.ModelInput([types.EncodedTextChunk([257, 10, 259]), types.ImageChunk(png(60, 40, seed=1), "png",
                          image_tokens(proc, png(60, 40, seed=1))), types.EncodedTextChunk([260, 65, 66, 10])]),
        types.ModelInput([types.EncodedTextChunk([257, 9]), types.ImageChunk(jpeg.data, "jpeg", jpeg.expected_tokens),
                          types.EncodedTextChunk([260, 7]),
                          types.ImageChunk(png(50, 90, seed=2), "png"),  # expected_tokens left to the server
                          types.EncodedTextChunk([260, 8, 9])]),
    ]
    def counted(mi: types.ModelInput) -> types.ModelInput:  # every image with the count the processor makes
        return types.ModelInput([types.ImageChunk(c.data, c.format, image_tokens(proc, c.data))
                                 if isinstance(c, types.ImageChunk) else c for c in mi.chunks])

    data = []
    for mi in inputs:
        ids = expanded_ids(counted(mi), IMAGE_PAD)
        data.append(types.Datum(model_input=mi, loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:] + [1], np.int64), "weights": np.ones(len(ids), np.float32)}))
    training = service.create_lora_training_client(base_model=str(vlm_dir), rank=4).result()
    with around_image_decodes(recording):
        out = training.forward([_theirs(d) for d in data], "cross_entropy").result()
    reference = reference_logprobs(vlm_dir, [types.Datum(model_input=counted(d.model_input),
                                                         loss_fn_inputs=d.loss_fn_inputs) for d in data])
    for got, want in zip(out.loss_fn_outputs, reference, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, atol=1e-4, rtol=0)
    # each distinct image decoded once, on the compute thread, not on the event loop's
    assert len(decoded_on) == 3 and srv.thread.name not in decoded_on


@pytest.mark.slow
def test_served_vlm_learns_two_colours_and_samples_them(service, vlm_dir):
    proc = processor(vlm_dir)
    red, blue = png(56, 56, color=(220, 30, 30)), png(56, 56, color=(30, 30, 220))
    (red_prompt, red_datum), (blue_prompt, blue_datum) = classifier_datum(proc, red, "red"), \
        classifier_datum(proc, blue, "blue")
    training = service.create_lora_training_client(base_model=str(vlm_dir), rank=8, seed=0).result()
    batch = [_theirs(red_datum), _theirs(blue_datum)]
    for _ in range(60):
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(tt.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    greedy = tt.SamplingParams(max_tokens=8, temperature=0.0)
    answers = []
    for prompt in (red_prompt, blue_prompt):
        sequence = sampler.sample(_prompt(prompt), num_samples=1, sampling_params=greedy).result().sequences[0]
        answers.append(bytes(t for t in sequence.tokens if t < 256))
    assert answers == [b"red", b"blue"]


def test_oversized_and_unserved_images_are_refused_by_name(service, vlm_dir):
    huge = png(5000, 4000, color=(1, 2, 3))  # 20 M pixels: over the default max_image_pixels
    prompt = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1, 2]), tt.ImageChunk(data=huge, format="png")])
    sampler = service.create_sampling_client(base_model=str(vlm_dir)).result()
    with pytest.raises(Exception, match=r"prompt 0: model_input.chunks\[1\]: the image is 5000x4000 = 20000000 "
                                        r"pixels, over the limit of 16777216 pixels per image \(max_image_pixels\)"):
        sampler.sample(prompt, num_samples=1, sampling_params=tt.SamplingParams(max_tokens=2)).result()
    training = service.create_lora_training_client(base_model=str(vlm_dir), rank=4).result()
    datum = tt.Datum(model_input=tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1, 2]), tt.ImageChunk(
        data=huge, format="png", expected_tokens=4)]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.ones(6, np.int64))})
    with pytest.raises(Exception, match=r"datum 0: model_input.chunks\[1\]: the image is 5000x4000"):
        training.forward_backward([datum], "cross_entropy").result()
    pointer = tt.ModelInput(chunks=[tt.EncodedTextChunk(tokens=[1]), tt.ImageAssetPointerChunk(
        format="png", location="/etc/hostname", expected_tokens=4)])
    with pytest.raises(Exception, match="'image_asset_pointer' chunks are not served"):
        sampler.sample(pointer, num_samples=1, sampling_params=tt.SamplingParams(max_tokens=2)).result()


@pytest.mark.slow
def test_cookbook_vlm_classifier_recipe(tmp_path, monkeypatch):
    """The recipe's dataset (an image folder of two colours, its class labels from the folder
    names), its renderer and evaluator, and the cookbook's supervised loop, unmodified."""
    import chz
    from PIL import Image
    from tinker_cookbook.recipes.vlm_classifier.data import ClassifierDataset, ClassifierDatasetConfig
    from tinker_cookbook.recipes.vlm_classifier.eval import ClassifierEvaluator, ClassifierEvaluatorConfig
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.types import SupervisedDatasetBuilder

    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    model = str(make_tiny_vlm(tmp_path / "model", "qwen3_vl"))
    folder = tmp_path / "colours"
    for split, n in (("train", 8), ("test", 4)):
        for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
            (folder / split / name).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (48 + 8 * i, 48), colour).save(folder / split / name / f"{i}.png")
    renderer = "qwen3_vl_instruct"

    @chz.chz
    class Colours(SupervisedDatasetBuilder):
        def __call__(self):
            return ClassifierDataset(ClassifierDatasetConfig(
                dataset=str(folder), dataset_split="train", model_name_for_tokenizer=model, renderer_name=renderer,
                batch_size=4, max_length=512, max_image_size=64)), None

    def evaluator():
        return ClassifierEvaluator(ClassifierEvaluatorConfig(
            dataset=str(folder), dataset_split="test", model_name_for_tokenizer=model, renderer_name=renderer,
            max_tokens=8, n_eval=8, max_image_size=64))

    with ServerThread(tmp_path / "state", models=[model]) as srv:
        config = train.Config(
            log_path=str(tmp_path / "log"), model_name=model, recipe_name="recipe_vlm_classifier",
            renderer_name=renderer, dataset_builder=Colours(), evaluator_builders=[evaluator], learning_rate=1e-2,
            lora_rank=8, base_url=srv.url, eval_every=4, save_every=0, num_epochs=2,
        )
        asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 8 and nll[-1] < 0.6 * nll[0]  # 16 images / batch 4, two epochs
    accuracy = [m["accuracy"] for m in metrics if "accuracy" in m]  # the recipe's sampling evaluator ran
    assert len(accuracy) >= 2 and all(0.0 <= a <= 1.0 for a in accuracy)


def test_another_owners_call_runs_between_the_images_of_a_call(vlm_dir, tmp_path):
    """Issue 41, items 2 and 3: docs/server.md promises another owner waits about one
    micro-batch. Before: a call's images were all decoded in one go (16 distinct 4096x4096 PNGs:
    6.7 s, and another owner's 4-token forward waited as long). Now the call gives way between
    two images as between micro-batches: Bob's forward, sent while Alice's first image decodes,
    runs before her second (in her paused call's gap, on the one compute thread), and Alice's call is unchanged."""
    import threading

    from _limits import HANG_S
    from skyrl_sdk.testing import around_image_decodes

    keys = {"tml-alice-0123456789": "alice", "tml-bob-0123456789ab": "bob"}
    reached, go = threading.Event(), threading.Event()

    def held_first(decode):  # Alice's first image holds until Bob's request is queued
        if not reached.is_set():
            reached.set()
            assert go.wait(HANG_S)
        return decode()

    proc = processor(vlm_dir)
    mi = types.ModelInput([types.EncodedTextChunk([257, 10])] + [
        types.ImageChunk(png(60, 40, seed=s), "png", image_tokens(proc, png(60, 40, seed=s))) for s in (1, 2, 3)])
    datum = types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": np.ones(mi.length, np.int64)})
    with ServerThread(tmp_path / "state", api_key=None, api_keys=keys, models=[str(vlm_dir), "tiny"]) as srv:
        alice_sc, bob_sc = (srv.service_client(api_key=k) for k in keys)
        alice = alice_sc.create_lora_training_client(base_model=str(vlm_dir), rank=2).result(timeout=HANG_S)
        bob = bob_sc.create_lora_training_client(base_model="tiny", rank=2).result(timeout=HANG_S)
        want = alice.forward([_theirs(datum)], "cross_entropy").result(timeout=HANG_S)
        with around_image_decodes(held_first):
            try:
                fut_a = alice.forward([_theirs(datum)], "cross_entropy")
                assert reached.wait(HANG_S)
                fut_b = bob.forward([tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3, 4]),
                                              loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})], "cross_entropy")
                queue, deadline = srv.runtime.models[bob.model_id].worker, time.monotonic() + HANG_S
                while queue.pending() == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            finally:
                go.set()
        fut_b.result(timeout=HANG_S)
        got = fut_a.result(timeout=HANG_S)
        assert ("bob", bob.model_id, True) in list(srv.runtime.executors.shared.history)  # inside Alice's call
        np.testing.assert_array_equal(got.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                      want.loss_fn_outputs[0]["logprobs"].to_numpy())
        alice_sc.close("success").result()
        bob_sc.close("success").result()
