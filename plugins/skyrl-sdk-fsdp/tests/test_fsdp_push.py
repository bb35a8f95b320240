"""The fsdp engine pushes its weights from its shards (``skyrl_sdk.plugins.weight_push``): each rank
sends only the rows it holds, the rows put together are exactly the weights an export writes
(LoRA: the base, unmerged), a ``gathered`` layout has rank 0 send whole tensors; the adapter
comes from memory. No inference engine is needed: a recording sender stands for one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.plugins.weight_push import PushTarget

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _train(backend) -> None:
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 30))),
                        loss_fn_inputs={"target_tokens": list(range(4, 31))})]
    backend.forward_backward(data, "cross_entropy")
    backend.optim_step(types.AdamParams(learning_rate=1e-2))


def _pushed(source, tmp_path: Path, gathered: bool, dtype: str = "float32") -> tuple:
    layout = source.push_layout(dtype, gathered=gathered)
    out = tmp_path / f"push-{gathered}-{dtype}"
    out.mkdir()
    target = PushTarget(sender="push_recorder:Recorder", options={"directory": str(out)}, key=f"test-{out.name}")
    source.push_weights(target, layout)
    per_rank = [torch.load(out / f"rank{r}.pt") for r in range(layout.ranks)]
    whole = {}
    for i, t in enumerate(layout.tensors):
        pieces = [(t.rows[r][0], per_rank[r][i]) for r in range(layout.ranks) if t.rows[r][1] > t.rows[r][0]]
        for r in range(layout.ranks):
            assert tuple(per_rank[r][i].shape) == t.slice_shape(r), (t.name, r)
        ordered = [p for _, p in sorted(pieces, key=lambda x: x[0])]
        whole[t.name] = ordered[0].reshape(()) if not t.shape else torch.cat(ordered)
    return layout, whole


def _exported(backend, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What ``save_weights_for_sampler`` writes (full fine-tuning: the current weights)."""
    export = tmp_path / "export"
    backend.save_weights_for_sampler(export)
    return load_file(str(next(export.glob("*.safetensors"))))


@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
def test_each_rank_sends_its_own_rows_and_they_make_the_weights(tmp_path, lora):
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2}, lora=lora) as b, \
            skyrl_sdk.Backend(model="tiny", lora=lora) as local:
        _train(b)
        _train(local)
        source = b.engine.weights_source()
        layout, whole = _pushed(source, tmp_path, gathered=False)
        both = [t for t in layout.tensors if all(stop > start for start, stop in t.rows)]
        assert both, "no tensor is split between the ranks"
        for t in layout.tensors:  # no row is sent twice
            covered = sum(stop - start for start, stop in t.rows)
            assert covered == (t.shape[0] if t.shape else 1), t.name
        if lora:  # the base, no adapter merged: the local engine's (the same seed, the base never trains)
            reference = {n: v.detach() for n, v in local.engine.weights_source().push_state().items()}
        else:
            reference = _exported(b, tmp_path)
        assert whole.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(whole[name], value.float(), rtol=0, atol=1e-5 if lora else 0, msg=name)
        gathered_layout, gathered = _pushed(source, tmp_path, gathered=True, dtype="bfloat16")
        assert all(t.rows[1] == (0, 0) for t in gathered_layout.tensors)
        for name, value in whole.items():
            torch.testing.assert_close(gathered[name], value.to(torch.bfloat16) if value.is_floating_point() else value,
                                       rtol=0, atol=0, msg=name)
        if lora:
            adapter = source.adapter_weights()
            mine = local.engine.weights_source().adapter_weights()
            assert adapter.tensors.keys() == mine.tensors.keys()
            for name, value in mine.tensors.items():
                torch.testing.assert_close(adapter.tensors[name], value, rtol=0, atol=1e-5, msg=name)
            assert adapter.config["r"] == 4 and adapter.config["target_modules"] == mine.config["target_modules"]


def test_a_failed_push_leaves_the_trainer_usable(tmp_path):
    with skyrl_sdk.Backend(model="tiny", engine="fsdp", engine_config={"world_size": 2}) as b:
        source = b.engine.weights_source()
        layout = source.push_layout("float32")
        target = PushTarget(sender="push_recorder:Recorder", options={"directory": str(tmp_path / "missing")},
                            key="test-failing")
        with pytest.raises(skyrl_sdk.errors.EngineError,
                           match=r"pushing the weights failed on rank 0: RuntimeError: Parent directory .*missing does not "
                                 r"exist.*; rank 1: RuntimeError"):
            source.push_weights(target, layout)
        _train(b)  # the engine is still usable


@pytest.mark.parametrize("extra, message", [
    ({"ray_address": "127.0.0.1:6379"}, r"engine_config\['ray_address'\] places the ranks with Ray: it needs launcher "
                                        r"'ray', not 'spawn'"),
    ({"launcher": "ray", "placement_strategy": "ANYWHERE"}, r"engine_config\['placement_strategy'\]: expected one of"),
    ({"launcher": "ray", "ray_address": ""}, r"engine_config\['ray_address'\]: expected 'host:port'"),
    ({"launcher": "rocket"}, r"engine_config\['launcher'\]: expected one of \['auto', 'spawn', 'torchrun', 'ray'\]"),
])
def test_the_ray_launcher_keys_are_checked_by_name(extra, message):
    from skyrl_sdk_fsdp.options import FSDPOptions

    with pytest.raises(skyrl_sdk.errors.InputError, match=message):
        FSDPOptions.from_extra({"launcher": "spawn", **extra})
