"""Prefix sharing on the fsdp engine (2 gloo ranks): a shared-prefix group stays on one rank,
the ranks compute it with its prefix once (the same ShardedScoringModel, FSDP2 units and
two-part attention as the local engine), and outputs, metrics and gradients equal the local
engine's unshared computation."""

from __future__ import annotations

import pytest

pytest.importorskip("skyrl_sdk_fsdp")

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.models.prefix import find_groups
from skyrl_sdk.testing import (
    assert_metrics_close,
    assert_outputs_close,
    assert_tensors_close,
    grads_of,
    make_group_data,
    torch_threads,
)
from skyrl_sdk_fsdp.split import split_by_tokens

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_groups_stay_on_one_rank_and_the_ranks_stay_balanced():
    data = make_group_data(((24, 3), (30, 4), (20, 5)), seed=30)
    seqs = [d.model_input.to_numpy() for d in data]
    groups, alone = find_groups(seqs, 16, 8192)
    parts = split_by_tokens([len(s) for s in seqs], 2, [(g.members, g.unique_tokens) for g in groups])
    assert sorted(i for p in parts for i in p) == list(range(len(data)))
    for g in groups:
        assert sum(set(g.members) <= set(p) for p in parts) == 1, g
    loads = [sum(g.unique_tokens for g in groups if set(g.members) <= set(p)) +
             sum(len(seqs[i]) for i in alone if i in p) for p in parts]
    assert max(loads) - min(loads) <= max(g.unique_tokens for g in groups)


def test_two_ranks_equal_the_local_unshared_engine():
    data = make_group_data(((24, 3), (30, 4)), seed=31)
    # one group and two singletons: one rank shares, the other does not
    first = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in make_group_data(((24, 4),), seed=32, odd_cases=False) + make_group_data(((30, 1), (31, 1)), seed=33,
                                                                                               odd_cases=False)]
    config = {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_reduction": "token_mean"}
    with torch_threads(1), \
            skyrl_sdk.Backend(model="tiny", engine="fsdp", dialect="native", engine_config={"world_size": 2}) as fsdp, \
            skyrl_sdk.Backend(model="tiny", dialect="native", engine_config={"prefix_sharing": False}) as local:
        assert fsdp.get_info().prefix_sharing.endswith("(self-test at the first use)")
        assert_outputs_close(fsdp.forward(first, "cross_entropy"), local.forward(first, "cross_entropy"), atol=1e-5)
        out_f = fsdp.forward_backward(data, "regular", config)
        # every rank ran the self-test (collectively) at that call, and passed it
        assert fsdp.get_info().prefix_sharing == "on: two-part attention over sdpa; heads of >= 16 tokens are computed once"
        out_l = local.forward_backward(data, "regular", config)
        assert_outputs_close(out_f, out_l, atol=1e-5)
        assert_metrics_close(out_f.metrics, out_l.metrics)
        assert_tensors_close(fsdp.engine.gradients(), grads_of(local), atol=1e-5, rtol=1e-5, what="grad")
        adam = types.AdamParams(learning_rate=1e-2)
        assert fsdp.optim_step(adam).metrics["grad_norm"] == pytest.approx(local.optim_step(adam).metrics["grad_norm"],
                                                                           rel=1e-5)
