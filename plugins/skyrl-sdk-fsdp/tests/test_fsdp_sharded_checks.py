"""A bad ``state_format="sharded"`` checkpoint is refused before any rank loads it, and
changes nothing: non-finite values, a negative second moment, a bad step, a metadata
pickle naming a foreign global, a data file outside the folder (issue 9)."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

pytest.importorskip("skyrl_sdk_fsdp")

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.errors import CheckpointError
from skyrl_sdk.testing import make_sft_data, torch_threads

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

ADAM = types.AdamParams(learning_rate=1e-2, grad_clip_norm=20.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _read_all(folder, tensors_only=False) -> dict:
    """Every item of a sharded folder as full tensors (test side: our own files)."""
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
             for k, m in saved.items() if isinstance(m, TensorStorageMetadata) or not tensors_only}
    dcp.load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


def _rewrite(folder, change) -> None:
    state = _read_all(folder)
    change(state)
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _snapshot(backend, path) -> dict:
    backend.save_state(path)
    return _read_all(path / "sharded", tensors_only=True)


class _RunsCode:
    """Unpickling this would create ``marker`` (it must never happen)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (shutil.copyfile, (__file__, self.marker))


def test_bad_sharded_states_are_refused_and_change_nothing(tmp_path):
    with skyrl_sdk.Backend(model="tiny", engine="fsdp",
                           engine_config={"world_size": 2, "state_format": "sharded"}) as fsdp:
        fsdp.forward_backward(make_sft_data([7, 12, 3], seed=31))
        fsdp.optim_step(ADAM)
        fsdp.save_state(tmp_path / "good")
        fsdp.forward_backward(make_sft_data([4, 6], seed=32))  # pending gradients must survive too
        before = _snapshot(fsdp, tmp_path / "before")
        grads_before = fsdp.engine.gradients()
        head, moment = "model.lm_head.weight", "optim.state.lm_head.weight"

        def poke(key, value):
            def change(state):
                state[key] = state[key].clone()
                state[key].view(-1)[0] = value
            return change

        marker = tmp_path / "pwned"
        cases = [
            (poke(head, float("nan")), rf"{head} \(in __\d_0.distcp.*\): holds non-finite"),
            (poke(f"{moment}.exp_avg", float("inf")), r"exp_avg .*non-finite"),
            (poke(f"{moment}.exp_avg_sq", -1.0), r"exp_avg_sq .*negative"),
            (poke(f"{moment}.step", float("nan")), r"step .*non-finite"),
            (poke(f"{moment}.step", -3.0), r"step .*negative"),
            (lambda s: s.pop(f"{moment}.step"), r"lm_head.weight.step: missing"),
            (lambda s: s.update({"model.extra.weight": torch.zeros(2)}), "model.extra.weight: not a weight"),
            ("pickle", "is not allowed in checkpoint metadata"),
            ("outside", "not a file in the folder"),
        ]
        for i, (change, message) in enumerate(cases):
            bad = tmp_path / f"bad{i}"
            shutil.copytree(tmp_path / "good", bad)
            folder = bad / "sharded"
            if change == "pickle":
                (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
            elif change == "outside":
                metadata = FileSystemReader(str(folder)).read_metadata()
                for info in metadata.storage_data.values():
                    info.relative_path = "../../good/sharded/" + info.relative_path
                (folder / ".metadata").write_bytes(pickle.dumps(metadata))
            else:
                _rewrite(folder, change)
            with pytest.raises(CheckpointError, match=message):
                fsdp.load_state(bad)
        assert not marker.exists()
        after = _snapshot(fsdp, tmp_path / "after")
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the state"
        grads_after = fsdp.engine.gradients()
        assert grads_before.keys() == grads_after.keys()
        assert all(np.array_equal(grads_before[k], grads_after[k]) for k in grads_before)
        # the engine is still usable and a good state still loads (also after a rewrite by dcp)
        fsdp.load_state(tmp_path / "good")
        shutil.copytree(tmp_path / "good", tmp_path / "rewritten")
        _rewrite(tmp_path / "rewritten" / "sharded", lambda s: None)
        fsdp.load_state(tmp_path / "rewritten")
        assert _snapshot(fsdp, tmp_path / "again").keys() == before.keys()
