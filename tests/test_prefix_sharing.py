"""Prefix sharing (engine_config ``prefix_sharing``): datums that start alike are computed with
their common head once, and every output, metric and gradient equals the unshared computation
(float32): every built-in loss and reduction, KL and entropy terms, weighted prompt positions,
LoRA, the critic, top-K targets, packed and cut micro-batches, activation checkpointing.
Also: how groups are found and laid out, the fallbacks, and the sampler's one prefill per prompt.
"""

from __future__ import annotations

import logging

import attrs
import numpy as np
import pytest
import torch

import skyrl_sdk
from skyrl_sdk import errors, get_registry, types
from skyrl_sdk.engines import sharing
from skyrl_sdk.models import prefix_attention
from skyrl_sdk.models.prefix import MIN_SAVED_FRACTION, find_groups, layout_groups
from skyrl_sdk.testing import around_micro_batches, assert_metrics_close, grads_of, make_group_data, make_sft_data

OFF = {"prefix_sharing": False}
REDUCTIONS = ["sum", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _rel_grads_close(a: dict, b: dict, rtol: float = 2e-6, what: str = "") -> None:
    """Gradients equal to float rounding: per tensor, |a - b| <= rtol * max(1, max |b|)."""
    assert a.keys() == b.keys() and a, what
    for k in a:
        scale = max(1.0, float(b[k].abs().max()))
        diff = float((a[k] - b[k]).abs().max())
        assert diff <= rtol * scale, f"{what} {k}: {diff:.3g} > {rtol} x {scale:.3g}"


def _outputs_close(a, b, atol: float = 1e-5, what: str = "") -> None:
    """Per-datum outputs: logprobs (values) within ``atol``; losses to float rounding (relative)."""
    assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs)
    for i, (x, y) in enumerate(zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True)):
        assert x.keys() == y.keys(), i
        for k in x:
            rtol = 0 if k in ("logprobs", "values") else 1e-5
            np.testing.assert_allclose(x[k].to_numpy(), y[k].to_numpy(), atol=atol, rtol=rtol,
                                       err_msg=f"{what} datum {i} {k}")


def _compare(shared, plain, data, loss_fn, config=None, atol=1e-5, rtol=2e-6):
    plain.zero_grad()
    shared.zero_grad()
    out_p = plain.forward_backward(data, loss_fn, config)
    out_s = shared.forward_backward(data, loss_fn, config)
    what = f"{loss_fn} {config}"
    _outputs_close(out_s, out_p, atol, what)
    assert_metrics_close(out_s.metrics, out_p.metrics, rtol=1e-5, atol=1e-5)
    _rel_grads_close(grads_of(shared), grads_of(plain), rtol, what)
    plain.zero_grad()
    shared.zero_grad()


def _only(data, *keys):
    """The datums with only these loss_fn_inputs."""
    return [types.Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                                    if k in keys}) for d in data]


CE = ("target_tokens", "weights")
RL = ("target_tokens", "weights", "advantages", "logprobs")


def _shares(backend, data) -> bool:
    return any(mb.prefix is not None for mb in backend.engine.runner.plan(data))


@pytest.fixture(scope="module")
def pair():
    with skyrl_sdk.Backend(seed=0, dialect="native") as shared, \
            skyrl_sdk.Backend(seed=0, dialect="native", engine_config=OFF) as plain:
        yield shared, plain


# ---- finding groups, laying them out -------------------------------------------------------
def test_groups_of_prompts_partial_heads_singletons_duplicates():
    data = make_group_data(seed=3)
    seqs = [d.model_input.to_numpy() for d in data]
    groups, alone = find_groups(seqs, 16, 8192)
    # the 3-sample group (+ a duplicate, + a strict prefix), the 4-sample group, the pair
    assert sorted((len(g.members), g.prefix) for g in groups) == [(2, 18), (4, 30), (5, 24)] and len(alone) == 1
    assert sorted([m for g in groups for m in g.members] + alone) == list(range(len(data)))
    for g in groups:
        heads = {seqs[m][:g.prefix].tobytes() for m in g.members}
        assert len(heads) == 1 and all(len(seqs[m]) >= g.prefix for m in g.members)
        assert g.unique_tokens == sum(len(seqs[m]) for m in g.members) - (len(g.members) - 1) * g.prefix
    # a longer minimum leaves the 18-token pair alone; a tiny budget cuts every group
    assert sorted(len(g.members) for g in find_groups(seqs, 20, 8192)[0]) == [4, 5]
    cut, _ = find_groups(seqs, 16, 40)
    assert cut and all(g.unique_tokens <= 40 and len(g.members) >= 2 for g in cut)


def test_grouping_saves_the_most_tokens_over_one_level():
    """A datum that shares only part of a group's prompt does not shrink the whole group's prefix."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, 40)
    group = [np.concatenate([prompt, rng.integers(0, 256, 8)]) for _ in range(4)]
    nested = np.concatenate([prompt[:25], rng.integers(0, 256, 12)])
    groups, alone = find_groups(group + [nested], 16, 8192)
    assert [(sorted(g.members), g.prefix) for g in groups] == [([0, 1, 2, 3], 40)] and alone == [4]
    # sharing too little is not worth it: 16 common tokens of two 200-token datums save 4%
    long = [np.concatenate([prompt[:16], rng.integers(0, 256, 184)]) for _ in range(2)]
    assert 16 / 400 < MIN_SAVED_FRACTION and find_groups(long, 16, 8192) == ([], [0, 1])


def test_layout_puts_every_datum_back_together():
    data = make_group_data(seed=4)
    seqs = [d.model_input.to_numpy() for d in data]
    groups, _ = find_groups(seqs, 16, 8192)
    row = layout_groups(seqs, groups)
    assert row.input_ids.shape[1] == sum(g.unique_tokens for g in groups) == row.plan.length
    for g in groups:
        for m in g.members:
            path = row.paths[m]
            np.testing.assert_array_equal(row.input_ids[0, path].numpy(), seqs[m])  # its tokens, in order
            np.testing.assert_array_equal(row.position_ids[0, path].numpy(), np.arange(len(seqs[m])))


# ---- shared == unshared, through the Backend ---------------------------------------------------
def test_a_group_call_is_planned_shared(pair):
    shared, plain = pair
    data = make_group_data(seed=0)
    assert shared.get_info().prefix_sharing.startswith("on: two-part attention over sdpa")
    assert plain.get_info().prefix_sharing == "off (engine_config prefix_sharing=false)"
    batches = shared.engine.runner.plan(data)
    assert shared.get_info().prefix_sharing == "on: two-part attention over sdpa; heads of >= 16 tokens are computed once"
    rows = [mb for mb in batches if mb.prefix is not None]
    assert len(rows) == 1 and rows[0].input_ids.shape[0] == 1
    assert sum(mb.flat_index.shape[0] for mb in batches) == sum(d.model_input.length for d in data)
    assert rows[0].input_ids.shape[1] < 0.6 * sum(len(data[i].model_input.to_ints()) for i in rows[0].datum_indices)
    assert not _shares(plain, data)


def _recorded_group_data(shared, plain):
    """GRPO groups sampled (recorded) from ``shared``, both Backends holding the records: the
    datums of a loss that needs provenance (``stable_reinforce``)."""
    from skyrl_sdk import rl

    prompts = [list(range(5, 25)), list(range(30, 48))]
    outs = shared.sample(prompts, {"max_tokens": 6, "seed": 3}, num_samples=4, record_stability_info=True)
    plain.sequences = shared.sequences
    data = []
    for prompt, out in zip(prompts, outs, strict=True):
        advantages = rl.group_advantages([float(i % 3) for i in range(len(out.sequences))])
        data += [rl.datum_from_sample(prompt, seq, a) for seq, a in zip(out.sequences, advantages, strict=True)]
    return data


@pytest.mark.parametrize("loss_fn", sorted(n for n, s in get_registry().losses.items() if s.role == "policy"))
def test_every_policy_loss_and_reduction_with_kl_and_entropy(pair, loss_fn):
    shared, plain = pair
    data = make_group_data(seed=1)
    if get_registry().losses[loss_fn].needs_provenance:  # its inputs come from recorded samples
        data = _recorded_group_data(shared, plain)
        data = [attrs.evolve(d, loss_fn_inputs={**d.loss_fn_inputs, "ref_logprobs": d.loss_fn_inputs["logprobs"]})
                if "logprobs" in d.loss_fn_inputs else d for d in data]
    if loss_fn in ("cross_entropy", "reinforce"):  # inputs they do not take
        data = _only(data, *CE, "ref_logprobs", *(("advantages",) if loss_fn == "reinforce" else ()))
    assert _shares(shared, data)
    for reduction in REDUCTIONS:
        config = {"loss_reduction": reduction, "kl_coef": 0.1, "entropy_coef": 0.01}
        if reduction == "seq_mean_token_sum_norm":
            config["max_seq_len"] = 64
        _compare(shared, plain, data, loss_fn, config)


def test_forward_and_accumulated_calls(pair):
    shared, plain = pair
    data = _only(make_group_data(seed=2), *RL)
    assert _shares(shared, data) and _shares(shared, data[:7]) and _shares(shared, data[7:])
    _outputs_close(shared.forward(data, "importance_sampling"), plain.forward(data, "importance_sampling"))
    for b in (shared, plain):  # gradients of successive calls add up, shared or not
        b.zero_grad()
        b.forward_backward(data[:7], "importance_sampling")
        b.forward_backward(data[7:], "importance_sampling")
    _rel_grads_close(grads_of(shared), grads_of(plain))


def test_topk_targets_share_the_backbone(pair):
    shared, plain = pair
    rng = np.random.default_rng(5)
    data = []
    for d in make_group_data(seed=5):
        n = d.model_input.length
        data.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": rng.integers(0, 256, (n, 3)), "weights": rng.random((n, 3)).astype(np.float32)}))
    assert _shares(shared, data)
    _compare(shared, plain, data, "cross_entropy")


@pytest.mark.parametrize("engine_config", [
    {"batching": "pack"},                 # the datums left alone go to a packed row
    {"micro_batch_tokens": 40},           # groups cut to the budget: each piece computes its prefix
    {"gradient_checkpointing": True},     # blocks recomputed in backward see the plan again
], ids=["pack", "cut_groups", "checkpointing"])
def test_layouts_and_checkpointing(engine_config):
    data = _only(make_group_data(seed=6), *RL)
    with skyrl_sdk.Backend(seed=0, dialect="native", engine_config=engine_config) as shared, \
            skyrl_sdk.Backend(seed=0, dialect="native", engine_config=OFF) as plain:
        assert _shares(shared, data)
        _compare(shared, plain, data, "regular", {"entropy_coef": 0.01})


# ---- memory: what a shared row keeps for backward ------------------------------------------------
def _kept_bytes_per_micro_batch(backend, data) -> list[int]:
    """Per micro-batch of one ``forward_backward``: bytes of the tensors autograd keeps for
    backward (distinct storages, the model's parameters left out)."""
    runner = backend.engine.runner
    params = {p.untyped_storage().data_ptr() for p in runner.scoring.model.parameters()}
    kept: list[int] = []

    def counting(compute):
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            per_token = compute()
        kept.append(sum(seen.values()))
        return per_token

    with around_micro_batches(counting):
        backend.forward_backward(data, "cross_entropy")
    backend.zero_grad()
    return kept


def _one_group(prompt_len: int, group: int, suffix: int, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 256, prompt_len)
    seqs = [np.concatenate([prompt, rng.integers(0, 256, suffix + 1)]) for _ in range(group)]
    return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
            for s in seqs]


@pytest.mark.slow  # the unshared side computes 25,856 tokens
@pytest.mark.parametrize("prompt_len, group, suffix", [(400, 64, 4), (120, 48, 30), (40, 8, 4)])
def test_a_shared_row_keeps_no_more_than_the_unshared_micro_batches(prompt_len, group, suffix):
    """The attention expands a group's prefix over its G rows (G x (P + S) slots per layer):
    what a row keeps of that is bounded by the micro-batch budget, so no micro-batch of the
    shared call keeps more than the unshared path's largest (400 tokens x 64: 5.5x more before)."""
    data = _one_group(prompt_len, group, suffix)
    cfg = {"micro_batch_tokens": 1024}
    with skyrl_sdk.Backend(seed=0, engine_config=cfg) as shared, \
            skyrl_sdk.Backend(seed=0, engine_config={**cfg, **OFF}) as plain:
        assert _shares(shared, data)
        kept_shared = _kept_bytes_per_micro_batch(shared, data)
        kept_plain = _kept_bytes_per_micro_batch(plain, data)
    assert max(kept_shared) <= max(kept_plain), (kept_shared, kept_plain)


def test_expansion_rows_bound_what_a_row_keeps():
    from skyrl_sdk.models.prefix import ExpansionBudget, expansion_rows

    # (count, prefix, width) -> (rows per call, kept): the first two fit what may be kept together,
    # the third runs in recomputed calls of 2 rows
    budget = ExpansionBudget(keep=1000, chunk=1000)
    assert expansion_rows([(4, 100, 10), (3, 50, 10), (40, 400, 20)], budget) == [(4, True), (3, True), (2, False)]
    # 540 slots do not fit the 160 left: one call of all 9 rows (within the chunk), not kept
    assert expansion_rows([(4, 100, 10), (9, 50, 10)], ExpansionBudget(keep=600, chunk=600)) == [(4, True), (9, False)]
    assert expansion_rows([(2, 5000, 1)], ExpansionBudget(keep=0, chunk=1000)) == [(1, False)]  # one row at least
    assert expansion_rows([(256, 1000, 4)], ExpansionBudget()) == [(256, True)]  # no bound: one call
    assert expansion_rows([(256, 1000, 4)], ExpansionBudget(chunk=8032)) == [(256, True)]  # nothing kept is bounded


def test_a_shared_row_repeats_at_most_32_positions_per_unshared_token():
    """Per-token outputs cover the prefix once per member: a row's positions are bounded too, so
    a huge group is cut into rows (each computing its prefix once)."""
    from skyrl_sdk.engines.batching import REPEATED_TOKENS_PER_TOKEN, make_micro_batches

    data = _one_group(200, 256, 4)  # 52224 positions; the unshared layout's micro-batches: 5 x 204
    batches = make_micro_batches(data, 1024, prefix_min_tokens=16)
    shared = [mb for mb in batches if mb.prefix is not None]
    assert len(shared) >= 2 and sum(len(mb.datum_indices) for mb in shared) == 256
    assert all(mb.flat_index.shape[0] <= REPEATED_TOKENS_PER_TOKEN * 5 * 204 for mb in shared)


@pytest.mark.parametrize("engine_config", [{}, {"gradient_checkpointing": True}, {"batching": "pack"}],
                         ids=["plain", "checkpointing", "pack"])
def test_a_group_run_in_chunks_of_rows_equals_the_unshared_call(engine_config):
    """Rows beyond the budget run in recomputed chunks: outputs, metrics and gradients are still
    the unshared call's, with model-level activation checkpointing too, and forward only."""
    data = _only(make_group_data(((60, 12), (40, 9)), seed=14), *RL, "ref_logprobs")
    cfg = {"micro_batch_tokens": 256, **engine_config}
    with skyrl_sdk.Backend(seed=0, dialect="native", engine_config=cfg) as shared, \
            skyrl_sdk.Backend(seed=0, dialect="native", engine_config=OFF) as plain:
        rows = [g for mb in shared.engine.runner.plan(data) if mb.prefix is not None for g in mb.prefix.groups]
        assert rows and any(0 < g.rows < g.count and not g.kept for g in rows)  # some group is chunked
        _compare(shared, plain, data, "regular", {"entropy_coef": 0.01, "kl_coef": 0.05})
        _outputs_close(shared.forward(data, "importance_sampling"), plain.forward(data, "importance_sampling"))


def test_lora():
    data = make_group_data(seed=7)
    lora = types.LoraConfig(rank=4, seed=1)
    with skyrl_sdk.Backend(seed=0, dialect="native", lora=lora) as shared, \
            skyrl_sdk.Backend(seed=0, dialect="native", lora=lora, engine_config=OFF) as plain:
        for b in (shared, plain):  # lora_B starts at zero: one step makes every adapter matter
            b.forward_backward(data, "regular", {"kl_coef": 0.05})
            b.optim_step(types.AdamParams(learning_rate=1e-2))
        assert _shares(shared, data)
        _compare(shared, plain, data, "regular", {"kl_coef": 0.05})


def test_critic():
    rng = np.random.default_rng(8)
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "values": rng.normal(size=d.model_input.length).astype(np.float32),
        "returns": rng.normal(size=d.model_input.length).astype(np.float32),
        "weights": d.loss_fn_inputs["weights"]}) for d in make_group_data(seed=8)]
    with skyrl_sdk.Backend(seed=0, role="critic", dialect="native") as shared, \
            skyrl_sdk.Backend(seed=0, role="critic", dialect="native", engine_config=OFF) as plain:
        assert shared.get_info().prefix_sharing.startswith("on") and _shares(shared, data)
        _compare(shared, plain, data, "value", {"loss_reduction": "seq_mean_token_mean"})


def test_bfloat16_mixed_precision_agrees_to_bf16_rounding():
    data = _only(make_group_data(seed=9), *CE)
    cfg = {"dtype": "bfloat16"}
    with skyrl_sdk.Backend(seed=0, engine_config=cfg) as shared, \
            skyrl_sdk.Backend(seed=0, engine_config={**cfg, **OFF}) as plain:
        assert _shares(shared, data)
        _outputs_close(shared.forward(data, "cross_entropy"), plain.forward(data, "cross_entropy"), atol=3e-2)


# ---- when it is off -------------------------------------------------------------------------
def test_an_unchecked_family_falls_back_and_says_why(monkeypatch):
    monkeypatch.setattr(prefix_attention, "SUPPORTED_MODEL_TYPES", frozenset({"gpt2"}))
    data = _only(make_group_data(seed=10), *CE)
    with skyrl_sdk.Backend(seed=0) as b, skyrl_sdk.Backend(seed=0, engine_config=OFF) as plain:
        assert b.get_info().prefix_sharing.startswith("off: model type 'llama' is not one prefix sharing was checked")
        assert not _shares(b, data)
        _outputs_close(b.forward(data, "cross_entropy"), plain.forward(data, "cross_entropy"), atol=0)


def test_a_failed_self_test_turns_sharing_off(monkeypatch, caplog):
    monkeypatch.setattr(sharing, "self_test", lambda scoring, device: 0.5)
    with caplog.at_level(logging.WARNING, logger="skyrl_sdk"), skyrl_sdk.Backend(seed=0) as b:
        assert b.get_info().prefix_sharing.endswith("(self-test at the first use)")
        b.forward(make_sft_data([30, 40], seed=1), "cross_entropy")  # nothing to share: nothing checked yet
        assert b.get_info().prefix_sharing.endswith("(self-test at the first use)")
        data = _only(make_group_data(seed=11), *CE)
        b.forward(data, "cross_entropy")  # the first call that shares runs the self-test: it runs unshared
        assert b.get_info().prefix_sharing.startswith("off: the self-test found shared and unshared scores 0.5 apart")
        assert not _shares(b, data)
        assert not prefix_attention.enabled(b.engine.loaded.module)  # back to plain sdpa
    assert any("prefix sharing off" in r.getMessage() for r in caplog.records)


def test_the_self_test_passes_on_the_real_model(pair):
    shared, _ = pair
    assert sharing.self_test(shared.engine.runner.scoring, torch.device("cpu")) <= 1e-5


def test_a_plan_on_a_model_that_would_ignore_it_is_refused(pair):
    _, plain = pair
    data = make_group_data(seed=12)
    row_batches = [mb for mb in plain.engine.runner.plan(data)]
    seqs = [d.model_input.to_numpy() for d in data]
    groups, _ = find_groups(seqs, 16, 8192)
    row = layout_groups(seqs, groups)
    flat = torch.from_numpy(np.concatenate([row.paths[m] for g in groups for m in g.members]))
    with pytest.raises(RuntimeError, match="not prefix-aware"):
        plain.engine.runner.scoring(row.input_ids, None, row.position_ids, flat, flat, prefix=row.plan)
    assert row_batches and all(mb.prefix is None for mb in row_batches)


@pytest.mark.parametrize("config, match", [
    ({"prefix_sharing": "yes"}, "engine_config\\['prefix_sharing'\\]: expected true, false or null"),
    ({"prefix_sharing_min_tokens": 0}, "prefix_sharing_min_tokens"),
    ({"prefix_sharing_min_tokens": 2.5}, "prefix_sharing_min_tokens"),
])
def test_bad_config_names_the_key(config, match):
    with pytest.raises(errors.InputError, match=match):
        skyrl_sdk.Backend(seed=0, engine_config=config)


# ---- sampling: one prefill per prompt -----------------------------------------------------------
def _prefill_rows(backend, monkeypatch) -> list[int]:
    """Rows of every multi-token backbone call (the prefills) during the next sampling calls."""
    rows = []
    emb = backend.engine.loaded.module.get_input_embeddings()
    original = emb.forward

    def counting(ids):
        if ids.shape[1] > 1:
            rows.append(ids.shape[0])
        return original(ids)

    monkeypatch.setattr(emb, "forward", counting)
    return rows


def test_repeated_prompts_are_prefilled_once(pair, monkeypatch):
    """The server merges a group's separate requests into ``sample([p, p, p], n=1)``: that is
    one prefill of ``p`` too (``num_samples`` always was), with the same draws as before."""
    from skyrl_sdk.sampling import decode

    shared, _ = pair
    p, q = list(range(1, 30)), [7, 8, 9]
    params = types.SamplingParams(max_tokens=6, seed=4, stop=[])
    rows = _prefill_rows(shared, monkeypatch)
    merged = shared.sample([p, p, q, p], params, num_samples=1, prompt_logprobs=True)
    grouped = shared.sample([p, q], params, num_samples=2)
    assert rows == [2, 2]  # p and q, once each, in both calls
    assert merged[0].prompt_logprobs == merged[3].prompt_logprobs and merged[2].prompt_logprobs[0] is None
    # every prompt prefilled on its own row, as before: the same tokens and logprobs
    monkeypatch.setattr(decode, "_distinct", lambda prompts: (list(prompts), np.arange(len(prompts))))
    rows.clear()
    again = shared.sample([p, p, q, p], params, num_samples=1, prompt_logprobs=True)
    assert rows == [4] and len(grouped) == 2
    for a, b in zip(merged, again, strict=True):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        np.testing.assert_allclose(a.sequences[0].logprobs, b.sequences[0].logprobs, atol=1e-5)


def test_bf16_sampler_logprobs_equal_forward_on_shared_rows():
    with skyrl_sdk.Backend(seed=0, engine_config={"dtype": "bfloat16"}) as b:
        prompt = list(range(40, 70))
        outs = b.sample([prompt], types.SamplingParams(max_tokens=8, seed=5, stop=[]), num_samples=3)
        data = [types.Datum(model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                            loss_fn_inputs={"target_tokens": (prompt + s.tokens)[1:]}) for s in outs[0].sequences]
        assert _shares(b, data)
        fwd = b.forward(data, "cross_entropy")
        for s, o in zip(outs[0].sequences, fwd.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(s.logprobs, o["logprobs"].to_numpy()[len(prompt) - 1:], atol=1e-3)


def test_a_self_test_that_raises_turns_sharing_off(monkeypatch):
    def broken(scoring, device):
        raise RuntimeError("an attention that cannot take the plan")

    monkeypatch.setattr(sharing, "self_test", broken)
    with skyrl_sdk.Backend(seed=0) as b:
        assert b.forward(_only(make_group_data(seed=13), *CE), "cross_entropy").loss_fn_outputs
        assert b.get_info().prefix_sharing.startswith("off: the self-test found shared and unshared scores inf apart")
