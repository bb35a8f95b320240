"""Futures classify failures by our own error types: only ``InputError`` is the caller's fault.

A plugin's malformed output (``PluginError``) and any other exception raised inside the
Backend (a bare ``ValueError`` or ``TypeError``, e.g. from torch) reach the tinker client
as server errors, never as user errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread
from skyrl_sdk.errors import DatumError, InputError, NotFoundError, PluginError
from skyrl_sdk.server.compute.futures import Result


def _category(exc: BaseException) -> tuple[str, str]:
    doc = json.loads(Result.from_exception(exc, "forward_backward").body)
    return doc["category"], doc["error"]


def test_classification_by_type():
    assert _category(InputError("bad")) == ("user", "bad")
    assert _category(DatumError("too long", index=2)) == ("user", "datum 2: too long")
    assert _category(NotFoundError("unknown model_id 'x'"))[0] == "user"
    category, message = _category(PluginError("loss 'my_loss' (plugin my-plugin) returned a non-scalar loss"))
    assert category == "server" and "plugin my-plugin" in message and "not a problem with your request" in message
    for exc in (ValueError("shape mismatch"), TypeError("expected LossOutput"), KeyError("lm_head")):
        category, message = _category(exc)
        assert category == "server" and type(exc).__name__ in message


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as srv:
        service = srv.service_client()
        tc = service.create_lora_training_client(base_model="tiny", rank=2).result()
        yield srv, tc
        service.close("success").result()


def _datum():
    return tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": tt.TensorData.from_numpy(np.array([2, 3, 4])),
        "weights": tt.TensorData.from_numpy(np.ones(3, np.float32))})


@pytest.mark.parametrize("exc,category", [
    (PluginError("loss 'bad' (plugin bad-plugin) returned a metric key 'x' without a reduction"),
     tt.RequestErrorCategory.Server),
    (ValueError("a bare ValueError from torch"), tt.RequestErrorCategory.Server),
    (TypeError("loss 'bad' returned dict, expected LossOutput"), tt.RequestErrorCategory.Server),
    (InputError("a real input problem"), tt.RequestErrorCategory.User),
])
def test_backend_exceptions_reach_the_client_by_type(trainer, monkeypatch, exc, category):
    srv, tc = trainer
    backend = srv.runtime.models[tc.model_id].backend

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(backend, "forward_backward_steps", fail)  # what the server's job runs
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward_backward([_datum()], "cross_entropy").result(timeout=HANG_S)
    assert err.value.category == category
    assert str(exc) in str(err.value)
    monkeypatch.undo()
    assert tc.forward_backward([_datum()], "cross_entropy").result(timeout=HANG_S).metrics["loss:sum"] > 0
