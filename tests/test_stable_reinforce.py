"""stable_reinforce: its formula against an independent reference, the promised property (a
stale sampler keeps its update bounded where importance sampling's grows), and the recorded
sequences and provenance it needs (docs/losses.md, "stable_reinforce")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from skyrl_sdk import Backend, rl
from skyrl_sdk.errors import DatumError, InputError, LossConfigError
from skyrl_sdk.evaluate import evaluate_loss
from skyrl_sdk.losses.stability import SequenceRecords
from skyrl_sdk.types import Datum, ModelInput, SampledSequence

N, N_PROMPT = 40, 8


@pytest.fixture
def make_backend():
    """Tiny LoRA Backends, closed after the test."""
    made = []

    def make(**kwargs):
        made.append(Backend(model="tiny", **kwargs))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def synthetic(seed: int, stale: float = 0.0, weights: bool = False):
    """Target logprobs and Tinker-shaped inputs: prompt positions (not sampled, A = 0) then
    sampled ones whose sampler logprob is ``lp - stale`` plus noise."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(N, generator=g) * 2.0 - 0.05
    q = lp - stale + 0.3 * torch.randn(N, generator=g)
    adv = torch.randn(N, generator=g)
    sampled = torch.ones(N)
    for t in (q, adv, sampled):
        t[:N_PROMPT] = 0.0
    inputs = {"logprobs": q, "advantages": adv, "sampled_mask": sampled}
    if weights:
        inputs["weights"] = (torch.rand(N, generator=g) < 0.8).float()
    return lp, inputs


def loss_and_grad(lp, inputs, config=None, name="stable_reinforce", dialect="native"):
    leaf = lp.clone().requires_grad_(True)
    loss, metrics = evaluate_loss(name, leaf, inputs, config, dialect=dialect)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kl_coeff,cap", [(0.0, 2.0), (0.3, 2.0), (0.1, 1.0), (0.0, 5.0)])
@pytest.mark.parametrize("weights", [False, True])
def test_formula_against_reference(seed, kl_coeff, cap, weights):
    lp, inputs = synthetic(seed, stale=0.4, weights=weights)
    q, adv, s = (inputs[k].double() for k in ("logprobs", "advantages", "sampled_mask"))
    m = inputs["weights"].double() if weights else torch.ones(N, dtype=torch.float64)
    d = (lp.double() - q).clamp(-20, 20)
    w = torch.minimum(d.exp(), torch.tensor(cap, dtype=torch.float64))
    coeff = w * (adv - kl_coeff * d) * s * m  # the REINFORCE weight of each token's grad lp
    loss, grad, metrics = loss_and_grad(lp, inputs, {"kl_coeff": kl_coeff, "ratio_cap": cap})
    torch.testing.assert_close(loss.double(), -coeff.sum(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), -coeff, atol=1e-5, rtol=1e-5)
    scored = (s != 0) & (m != 0)
    assert metrics["weight_max:max"] == pytest.approx(float(w[scored].max()), abs=1e-6)
    assert metrics["num_loss_tokens:sum"] == float(scored.sum())


def test_on_policy_it_is_reinforce_and_importance_sampling():
    """With the sampler equal to the learner the weight is 1: the same loss and gradient as
    importance_sampling, whose gradient is REINFORCE's -A grad lp."""
    lp, inputs = synthetic(3)
    inputs["logprobs"] = torch.where(inputs["sampled_mask"] != 0, lp, torch.zeros_like(lp))
    loss, grad, _ = loss_and_grad(lp, inputs)
    is_inputs = {k: v for k, v in inputs.items() if k != "sampled_mask"}
    is_loss, is_grad, _ = loss_and_grad(lp, is_inputs, name="importance_sampling")
    torch.testing.assert_close(loss, is_loss)
    torch.testing.assert_close(grad, is_grad)
    torch.testing.assert_close(grad, -inputs["advantages"])


@pytest.mark.parametrize("stale", [0.0, 1.0, 2.0, 4.0, 8.0, 16.0])
def test_per_token_update_is_bounded_where_importance_sampling_grows(stale):
    """A sampler ``stale`` nats less confident than the learner: importance sampling's
    per-token coefficient grows like exp(stale); stable_reinforce's never exceeds ratio_cap * |A|."""
    lp, inputs = synthetic(4, stale=stale)
    adv = inputs["advantages"].abs()
    _, grad, metrics = loss_and_grad(lp, inputs)
    assert bool((grad.abs() <= 2.0 * adv + 1e-6).all())
    is_inputs = {k: v for k, v in inputs.items() if k != "sampled_mask"}
    _, is_grad, _ = loss_and_grad(lp, is_inputs, name="importance_sampling")
    sampled = inputs["sampled_mask"] != 0
    growth = (is_grad.abs()[sampled] / adv[sampled]).max()
    assert float(growth) > 0.5 * math.exp(stale)  # noise +-0.3 nats around the offset
    assert metrics["weight_max:max"] <= 2.0


def test_tinker_dialect_config():
    lp, inputs = synthetic(5, stale=0.2)
    a = loss_and_grad(lp, inputs, {"kl_coeff": 0.2}, dialect="tinker")
    b = loss_and_grad(lp, inputs, {"kl_coeff": 0.2, "ratio_cap": 2.0}, dialect="native")
    torch.testing.assert_close(a[1], b[1])
    with pytest.raises(LossConfigError, match="kl_coef.*accepted keys.*kl_coeff"):
        loss_and_grad(lp, inputs, {"kl_coef_typo": 0.2}, dialect="tinker")
    with pytest.raises(LossConfigError, match="ratio_cap"):
        loss_and_grad(lp, inputs, {"ratio_cap": 0.5}, dialect="tinker")


# ---- in process: a real sampler, its records and a deliberately stale one ---------------------


def recorded_data(backend, seed=1):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = backend.sample(prompts, {"max_tokens": 8, "seed": seed}, num_samples=4, record_stability_info=True)
    data = []
    for prompt, out in zip(prompts, outs, strict=True):
        advantages = rl.group_advantages([float(i % 3) for i in range(len(out.sequences))])
        data += [rl.datum_from_sample(prompt, s, a) for s, a in zip(out.sequences, advantages, strict=True)]
    return data, outs


def grad_norm(backend, data, loss_fn):
    """The gradient norm of one call (the step has learning rate 0: the weights stay)."""
    backend.forward_backward(data, loss_fn)
    return backend.optim_step({"learning_rate": 0.0}).metrics["grad_norm"]


@pytest.mark.slow
def test_stale_sampler_update_stays_bounded_where_importance_sampling_grows(make_backend):
    """Sample (recorded) at step 0, then move the learner away with SFT steps: the sampler is
    stale. importance_sampling's ratios and gradient grow with the staleness; stable_reinforce's
    update is REINFORCE with each advantage scaled by at most ratio_cap: exactly the gradient of
    cross_entropy with weights w * A, w in [0, 2]."""
    backend = make_backend(lora={"rank": 8}, seed=0)
    data, _ = recorded_data(backend)
    sft = [Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "weights": (d.loss_fn_inputs["advantages"].to_numpy() != 0).astype(np.float32)}) for d in data[:4]]
    ratios, norm_ratios = [], []
    for _ in range(4):
        out = backend.forward_backward(data, "stable_reinforce")
        sr_norm = backend.optim_step({"learning_rate": 0.0}).metrics["grad_norm"]
        weights = [o["importance_weight"].to_numpy() for o in out.loss_fn_outputs]
        assert max(float(w.max()) for w in weights) <= 2.0
        as_reinforce = [Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "weights": w * d.loss_fn_inputs["advantages"].to_numpy()}) for d, w in zip(data, weights, strict=True)]
        assert grad_norm(backend, as_reinforce, "cross_entropy") == pytest.approx(sr_norm, rel=1e-4)
        is_out = backend.forward(data, "importance_sampling")
        ratios.append(is_out.metrics["ratio_max:max"])
        norm_ratios.append(grad_norm(backend, data, "importance_sampling") / sr_norm)
        for _step in range(3):  # the learner moves on; the recorded sampler does not
            backend.forward_backward(sft, "cross_entropy")
            backend.optim_step({"learning_rate": 2e-2})
    assert ratios[0] == pytest.approx(1.0, abs=1e-4) and norm_ratios[0] == pytest.approx(1.0, abs=1e-3)
    assert max(ratios) > 10.0
    print("ratio_max", ratios, "IS / SR gradient norm", norm_ratios)
    assert norm_ratios[-1] > 3.0


def variant(datum: Datum, model_input=None, **inputs) -> Datum:
    """``datum`` with its provenance, a changed model input and/or changed loss inputs."""
    return Datum(model_input=datum.model_input if model_input is None else model_input,
                 loss_fn_inputs={**datum.loss_fn_inputs, **inputs},
                 model_input_spans=datum.model_input_spans, loss_fn_input_spans=datum.loss_fn_input_spans)


def test_provenance_is_checked_against_the_records(make_backend):
    backend = make_backend(lora={"rank": 4})
    data, outs = recorded_data(backend)
    good = data[0]
    assert good.model_input_spans[0].sequence_id == outs[0].sequences[0].sequence_id
    backend.forward_backward([good], "stable_reinforce")
    tokens = good.model_input.to_numpy().copy()
    tokens[5] = (tokens[5] + 1) % 200
    with pytest.raises(DatumError, match=r"datum 1: model_input_spans: position 5 is token .* but the span names"):
        backend.forward_backward([good, variant(good, ModelInput.from_ints(tokens))], "stable_reinforce")
    adv = good.loss_fn_inputs["advantages"].to_numpy().copy()
    adv[1] = 0.5
    with pytest.raises(DatumError, match=r"advantages.*position 1 has a nonzero advantage but is not a sampled token"):
        backend.forward_backward([variant(good, advantages=adv)], "stable_reinforce")
    lps = good.loss_fn_inputs["logprobs"].to_numpy().copy()
    lps[-1] += 0.5
    with pytest.raises(DatumError, match=r"logprobs.*differs from the recorded sampler logprob"):
        backend.forward_backward([variant(good, logprobs=lps)], "stable_reinforce")
    with pytest.raises(DatumError, match="datum 0: this loss needs provenance"):
        backend.forward_backward([Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)],
                                 "stable_reinforce")
    with pytest.raises(DatumError, match="sampled_mask.*computed from the datum's provenance"):
        backend.forward_backward([variant(good, sampled_mask=np.ones(len(tokens), np.float32))], "stable_reinforce")
    other = make_backend(lora={"rank": 4})  # another Backend's records do not hold these ids
    with pytest.raises(InputError, match="sequence_id 'sample-.*names no recorded sequence"):
        other.forward_backward([good], "stable_reinforce")


@pytest.mark.parametrize("key, position", [("logprobs", 0), ("logprobs", -1), ("advantages", 0), ("advantages", -1)])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_inputs_are_refused_as_every_loss_refuses_them(make_backend, key, position, value):
    """Issue 41, item 17. Before: NaN logprobs at a prompt position passed the comparison with
    the records (NaN * 0 is NaN, and NaN > tolerance is false) and were then replaced, so
    stable_reinforce trained on them where importance_sampling refuses them; a NaN advantage at
    a prompt position was refused as "a nonzero advantage". Now both get the message every loss
    gives."""
    backend = make_backend(lora={"rank": 4})
    data, _ = recorded_data(backend)
    values = data[0].loss_fn_inputs[key].to_numpy().copy()
    values[position] = value
    flat = position % values.size
    plain = Datum(model_input=data[0].model_input, loss_fn_inputs={**data[0].loss_fn_inputs, key: values})
    with pytest.raises(DatumError) as refused_is:
        backend.forward_backward([plain], "importance_sampling")
    with pytest.raises(DatumError) as refused_sr:
        backend.forward_backward([variant(data[0], **{key: values})], "stable_reinforce")
    assert str(refused_sr.value) == str(refused_is.value)
    assert f"expected finite values, got {value} at flat position {flat}" in str(refused_sr.value)


def test_refused_calls_leave_no_gradient(make_backend):
    backend = make_backend(lora={"rank": 4})
    data, _ = recorded_data(backend)
    reference = grad_norm(backend, data[:2], "stable_reinforce")
    bad = Datum(model_input=data[1].model_input, loss_fn_inputs=data[1].loss_fn_inputs)
    with pytest.raises(DatumError):
        backend.forward_backward([data[0], bad], "stable_reinforce")
    assert grad_norm(backend, data[:2], "stable_reinforce") == pytest.approx(reference, rel=1e-6)


def test_records_expire_a_day_after_sampling_renewed_on_use_and_are_bounded():
    now = [0.0]
    records = SequenceRecords(ttl_s=100.0, max_tokens=30, clock=lambda: now[0])
    seq = SampledSequence(tokens=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], stop_reason="length")
    records.record(np.array([7, 8]), [seq, seq], ["a", "b"])
    assert len(records) == 2 and records.tokens == 10
    now[0] = 90.0
    records.use(["a"])  # renews a until 190
    now[0] = 150.0
    assert set(records.use(["a"])) == {"a"}
    with pytest.raises(InputError, match="'b' names no recorded sequence"):
        records.use(["b"])  # expired at 100
    assert len(records) == 1
    records.record(np.arange(10), [seq, seq], ["c", "d"])  # 5 + 13 + 13 tokens > 30: the oldest goes
    assert records.evicted == 1 and set(records.use(["c", "d"])) == {"c", "d"}
    with pytest.raises(InputError, match="'a' names no recorded sequence"):
        records.use(["a"])


def test_provenance_type_checks():
    from skyrl_sdk.types import PromptProvenanceSpan, SampledProvenanceSpan

    d = Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(InputError, match="model_input_spans: the provenance spans cover 2 positions but the field has 3"):
        d.with_provenance([PromptProvenanceSpan("s", 2)], [PromptProvenanceSpan("s", 3)])
    with pytest.raises(InputError, match="provenance comes as a pair"):
        Datum(model_input=[1], loss_fn_inputs={"target_tokens": [2]}, model_input_spans=[PromptProvenanceSpan("s", 1)])
    with pytest.raises(InputError, match=r"loss_fn_input_spans\[0\]: expected 'kind' to be 'prompt' or 'sampled'"):
        d.with_provenance([SampledProvenanceSpan("s", 3)], [{"kind": "output", "sequence_id": "s", "length": 3}])
    with pytest.raises(InputError, match="length"):
        SampledProvenanceSpan("s", -1)


def _cookbook_rl_loop_provenance():
    """tinker-cookbook's ``recipes/rl_loop.py`` ``with_sampled_provenance``, taken from the
    installed file (importing the module needs the math-rl extras it imports at the top)."""
    import ast
    import importlib.util

    tinker = pytest.importorskip("tinker")
    spec = importlib.util.find_spec("tinker_cookbook.recipes.rl_loop")
    if spec is None:
        pytest.skip("pip install --no-deps tinker-cookbook (see docs/server.md)")
    tree = ast.parse(open(spec.origin).read())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "with_sampled_provenance")
    namespace = {"types": tinker.types}
    exec(compile(ast.Module(body=[func], type_ignores=[]), spec.origin, "exec"), namespace)
    return namespace["with_sampled_provenance"], tinker.types


def test_tinker_cookbooks_rl_loop_datums_train_as_the_same_datums_with_prompt_targets(make_backend):
    """tinker-cookbook's rl_loop recipe (default loss: stable_reinforce) sends 0 as the target of
    every prompt position while its spans name the prompt there. Those positions train nothing
    (advantage 0), so they are not compared: its datums give the loss of the same datums with
    the prompt's tokens as targets (they used to be refused: "position 0 is token 0 but the span
    names token 5"); a sampled target that is not the recorded one is still refused."""
    with_sampled_provenance, tt = _cookbook_rl_loop_provenance()
    backend = make_backend(lora={"rank": 4})
    prompt = [5, 6, 7, 8]
    out = backend.sample([prompt], {"max_tokens": 5, "seed": 2, "stop": []}, num_samples=2, record_stability_info=True)
    cookbook, ours = [], []
    for seq, advantage in zip(out[0].sequences, [1.0, -1.0], strict=True):
        ob_len = len(prompt) - 1
        model_input = tt.ModelInput.from_ints(prompt).append(tt.EncodedTextChunk(tokens=list(seq.tokens[:-1])))
        datum = tt.Datum(model_input=model_input, loss_fn_inputs={   # the recipe's layout
            "target_tokens": [0] * ob_len + list(seq.tokens), "logprobs": [0.0] * ob_len + list(seq.logprobs),
            "advantages": [0.0] * ob_len + [advantage] * len(seq.tokens)})
        cookbook.append(with_sampled_provenance(datum, len(prompt), len(seq.tokens), seq.sequence_id))
        ours.append(rl.datum_from_sample(prompt, seq, advantage))
    theirs = backend.forward_backward(cookbook, "stable_reinforce").metrics
    backend.zero_grad()
    assert theirs["loss:sum"] == backend.forward_backward(ours, "stable_reinforce").metrics["loss:sum"]
    assert theirs["num_loss_tokens:sum"] == 10.0
    backend.zero_grad()
    targets = ours[0].loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 200
    with pytest.raises(DatumError, match=r"loss_fn_input_spans: position \d+ is token .* but the span names"):
        backend.forward_backward([variant(ours[0], target_tokens=targets)], "stable_reinforce")
