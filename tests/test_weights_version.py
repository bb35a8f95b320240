"""The weights have one version, the engine's (``Engine.weights_version``): the Backend, the
sampler's ``WeightsSource`` and the server's training models all read it; it moves on every
change of the weights and only then. The server snapshots weights through the ``Engine``
contract (``copy_trainable`` / ``load_trainable``), whatever the engine's class."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.engines import Engine, LocalEngine
from skyrl_sdk.server.compute.sessions import TrainingModel
from skyrl_sdk.server.compute.snapshots import load_snapshot, take_snapshot
from skyrl_sdk.testing import make_sft_data

SRC = Path(skyrl_sdk.__file__).parent


def _step(backend, learning_rate: float = 5e-2):
    backend.forward_backward(make_sft_data([6, 4]), "cross_entropy")
    return backend.optim_step(types.AdamParams(learning_rate=learning_rate))


def test_one_version_everywhere_moving_on_each_change_and_only_then(tmp_path):
    with skyrl_sdk.Backend(model="tiny") as b:
        source = b.engine.weights_source()
        served = TrainingModel("m", "owner", "session", "tiny", None, None, None, None, backend=b)

        def versions() -> set[int]:
            return {b.engine.weights_version, b.weights_version, source.version, served.weights_version}

        assert versions() == {0}
        _step(b)
        assert versions() == {1}
        b.save_state(tmp_path / "state")
        b.forward(make_sft_data([4]), "cross_entropy")
        b.sample([[1, 2]], {"max_tokens": 1})
        assert versions() == {1}  # reading the weights changes nothing
        b.forward_backward(make_sft_data([6]), "cross_entropy")
        for _, p in b.engine.runner.named_trainable():  # a non-finite gradient: the step is skipped
            p.grad = torch.full_like(p, float("nan"))
        assert _step(b).metrics["skipped"] == 1.0
        assert versions() == {1}  # nothing changed, so a sampler's copy stays valid
        b.load_state(tmp_path / "state")
        assert versions() == {2}
        b.weights_changed()  # whoever changes the weights another way says so
        assert versions() == {3}
        b.engine.load_trainable(b.engine.copy_trainable(2**40))  # the server's snapshot load
        assert versions() == {4}


class Wrapping(Engine):
    """An engine plugin that holds a local engine rather than being one (no subclass of it)."""

    name = "wrapping"

    def __init__(self, **kwargs) -> None:
        self.inner = LocalEngine(**kwargs)
        self.info, self.tokenizer = self.inner.info, self.inner.tokenizer

    def run(self, data, loss, *, backward):
        return self.inner.run(data, loss, backward=backward)

    def optim_step(self, params, grad_scale=1.0):
        return self.inner.optim_step(params, grad_scale)

    def zero_grad(self):
        self.inner.zero_grad()

    def copy_trainable(self, max_bytes):
        return self.inner.copy_trainable(max_bytes)

    def load_trainable(self, tensors):
        self.inner.load_trainable(tensors)
        self.weights_changed()

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("lora", [None, types.LoraConfig(rank=2)], ids=["full", "lora"])
def test_the_server_snapshots_any_engine_through_the_engine_contract(lora):
    data = make_sft_data([7, 5])
    with skyrl_sdk.Backend(model="tiny", engine=Wrapping, lora=lora) as trained, \
            skyrl_sdk.Backend(model="tiny", engine=Wrapping, lora=lora) as sampler:
        _step(trained)
        snap = take_snapshot("m", trained, max_bytes=2**40)
        assert snap is not None and (snap.model_id, snap.version) == ("m", 1)
        assert snap.nbytes == sum(t.numel() * t.element_size() for t in snap.tensors.values())
        assert all(t.device.type == "cpu" for t in snap.tensors.values())
        assert take_snapshot("m", trained, max_bytes=snap.nbytes - 1) is None  # over the budget: on disk instead
        load_snapshot(sampler, snap.tensors)
        assert sampler.weights_version == 1  # its sampler reloads
        want = trained.forward(data, "cross_entropy").loss_fn_outputs
        got = sampler.forward(data, "cross_entropy").loss_fn_outputs
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(w["logprobs"].to_numpy(), g["logprobs"].to_numpy())


def test_an_engine_without_memory_copies_is_snapshotted_on_disk():
    class NoCopies(Wrapping):
        copy_trainable = Engine.copy_trainable
        load_trainable = Engine.load_trainable

    with skyrl_sdk.Backend(model="tiny", engine=NoCopies) as b:
        assert take_snapshot("m", b, max_bytes=2**40) is None
        with pytest.raises(skyrl_sdk.errors.InputError, match="engine 'wrapping' cannot load trained tensors"):
            b.engine.load_trainable({})


def test_the_server_and_the_facade_use_only_the_engine_contract():
    """No engine class is tested for, and no engine internals (its runner, its shared base, its
    adapter) are read, by the server or the Backend: they would work for one engine only."""
    reaching = re.compile(r"isinstance\(.*\b(LocalEngine|AdapterEngine|ReadOnlyBaseEngine)\b"
                          r"|engine\.(runner|shared|adapter|loaded)\b|getattr\([^)]*[\"'](runner|shared|adapter)[\"']"
                          r"|from \.+engines\.(local|adapter|pool)\b")
    files = [SRC / "backend.py", *sorted((SRC / "server").rglob("*.py"))]
    found = [f"{f.relative_to(SRC)}:{n}: {line.strip()}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1) if reaching.search(line)]
    assert found == []
