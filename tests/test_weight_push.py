"""The weight-push contract (``skyrl_sdk.plugins.weight_push``) on the local engine: one trainer rank
holding every row, tied tensors sent once, current values in the wire dtype; a sender is built per
target and replaced when its generation moves; a name that is no sender is refused by name."""

from __future__ import annotations

import pytest
import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.errors import InputError, PluginError
from skyrl_sdk.plugins import weight_push
from skyrl_sdk.plugins.weight_push import PushTarget, WeightSender


class Keeper(WeightSender):
    built: list = []

    def __init__(self, *, tag: str) -> None:
        self.tag, self.got, self.closed = tag, None, False
        Keeper.built.append(self)

    def send(self, rank, layout, slices):
        self.got = (rank, layout, [s.clone() for s in slices])

    def close(self):
        self.closed = True


def _target(generation: int = 0, tag: str = "a") -> PushTarget:
    return PushTarget(sender=f"{__name__}:Keeper", options={"tag": tag}, key="test-weight-push", generation=generation)


def test_the_local_engine_pushes_its_current_weights_once_each():
    with skyrl_sdk.Backend(model="tiny") as b:
        b.forward_backward([types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5, 6]),
                                        loss_fn_inputs={"target_tokens": [4, 5, 6, 7]})], "cross_entropy")
        b.optim_step(types.AdamParams(learning_rate=1e-2))
        source = b.engine.weights_source()
        layout = source.push_layout("bfloat16")
        assert layout.ranks == 1 and not layout.gathered
        state = dict(b.engine.loaded.module.state_dict())
        tied = {n for n, t in state.items() for m, u in state.items() if m < n and t.data_ptr() == u.data_ptr()}
        names = [t.name for t in layout.tensors]
        assert len(names) == len(set(names)) and not set(names) & tied
        source.push_weights(_target(), layout)
        rank, got_layout, slices = Keeper.built[-1].got
        assert rank == 0 and got_layout == layout
        live = source.push_state()
        for spec, value in zip(layout.tensors, slices, strict=True):
            assert value.dtype == torch.bfloat16 and tuple(value.shape) == spec.shape
            torch.testing.assert_close(value, live[spec.name].detach().to(torch.bfloat16), rtol=0, atol=0)
    weight_push.drop_sender("test-weight-push")


def test_senders_are_kept_per_target_and_rebuilt_for_a_new_generation():
    first = weight_push.sender_for(_target(1))
    assert weight_push.sender_for(_target(1, tag="ignored")) is first
    second = weight_push.sender_for(_target(2))
    assert second is not first and first.closed
    weight_push.drop_sender("test-weight-push")
    assert second.closed


def test_a_sender_that_is_not_one_is_refused_by_name():
    with pytest.raises(PluginError, match="'builtins:dict' is not a skyrl_sdk WeightSender subclass"):
        weight_push.sender_for(PushTarget(sender="builtins:dict", key="test-bad"))
    with pytest.raises(PluginError, match="cannot import the sender 'no_such_module:X'"):
        weight_push.sender_for(PushTarget(sender="no_such_module:X", key="test-bad"))


def test_a_source_that_cannot_push_says_so():
    class Plain(skyrl_sdk.sampling.WeightsSource):
        model_name = "m"
        version = 0

        def export_base(self, directory):
            pass

        def decoder(self):
            pass

    with pytest.raises(InputError, match="model m: this engine cannot push its weights"):
        Plain().push_layout("float32")
