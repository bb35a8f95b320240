"""docs/rl.md: its first python block runs as written and learns; the helpers it uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _limits import HANG_S
from skyrl_sdk import types
from skyrl_sdk.errors import InputError
from skyrl_sdk.rl import datum_from_sample, group_advantages

DOC = Path(__file__).resolve().parents[1] / "docs" / "rl.md"


def first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_the_recipe_runs_as_written_and_the_reward_rises(tmp_path):
    script = tmp_path / "rl.py"
    script.write_text(first_python_block(DOC.read_text()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [float(m) for m in re.findall(r"^step +\d+ +mean reward ([-+.\d]+)$", proc.stdout, re.M)]
    assert len(rewards) == 40, proc.stdout
    assert np.mean(rewards[:5]) < 0.2 and np.mean(rewards[-5:]) > 0.9, rewards  # the doc says 0.03 -> 1.0
    assert "Traceback" not in proc.stderr and "FutureWarning" not in proc.stderr, proc.stderr


def test_group_advantages_match_the_formula():
    rewards = [1.0, 0.0, 0.5, 0.5]
    r = np.array(rewards)
    np.testing.assert_allclose(group_advantages(rewards), (r - r.mean()) / (r.std() + 1e-6), rtol=1e-12)
    np.testing.assert_allclose(group_advantages(rewards, normalize=False), r - r.mean(), rtol=1e-12)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]  # no signal: zeros, not a division by 0
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(InputError, match="rewards"):
            group_advantages(bad)


def test_datum_from_sample_layout():
    prompt = [256, 51, 50, 63]
    sample = types.SampledSequence(tokens=[55, 56, 257], logprobs=[-0.5, -1.0, -2.0], stop_reason="stop")
    datum = datum_from_sample(prompt, sample, 0.75)
    full = prompt + sample.tokens
    assert datum.model_input.to_ints() == full[:-1]
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    assert inputs == {
        "target_tokens": full[1:],
        "logprobs": [0.0, 0.0, 0.0, -0.5, -1.0, -2.0],
        "advantages": [0.0, 0.0, 0.0, 0.75, 0.75, 0.75],
    }
    # the sampled tokens sit where they are predicted: target i is the token after position i
    completion = slice(len(prompt) - 1, None)
    assert inputs["target_tokens"][completion] == sample.tokens


def test_datum_from_sample_weights_mark_the_completion():
    """weights=True adds a 0/1 mask over the completion; the other keys are unchanged."""
    prompt = [256, 51, 50, 63]
    sample = types.SampledSequence(tokens=[55, 56, 257], logprobs=[-0.5, -1.0, -2.0], stop_reason="stop")
    plain, masked = datum_from_sample(prompt, sample, 0.75), datum_from_sample(prompt, sample, 0.75, weights=True)
    assert masked.loss_fn_inputs["weights"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert {k: v.tolist() for k, v in masked.loss_fn_inputs.items() if k != "weights"} == \
        {k: v.tolist() for k, v in plain.loss_fn_inputs.items()}
    assert "weights" not in plain.loss_fn_inputs


def test_datum_from_sample_trains_only_the_completion():
    """The loss's gradient on prompt positions is zero: compare with the completion alone."""
    import torch

    from skyrl_sdk.evaluate import evaluate_loss

    prompt = [256, 51, 50]
    sample = types.SampledSequence(tokens=[55, 257], logprobs=[-0.5, -1.5], stop_reason="stop")
    datum = datum_from_sample(prompt, sample, -1.25)
    n = datum.model_input.length
    lp = torch.linspace(-3.0, -0.1, n, requires_grad=True)
    inputs = {k: v.to_torch() for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}
    loss, _ = evaluate_loss("importance_sampling", lp, inputs, dialect="tinker")
    loss.backward()
    ratio = torch.exp(lp.detach()[2:] - torch.tensor([-0.5, -1.5]))
    assert torch.allclose(loss, (1.25 * ratio).sum())
    assert torch.all(lp.grad[:2] == 0) and torch.allclose(lp.grad[2:], 1.25 * ratio)


@pytest.mark.parametrize(
    "prompt, tokens, logprobs, advantage, match",
    [
        ([], [1], [-1.0], 1.0, "prompt"),
        ([1], [], [], 1.0, "completion is empty"),
        ([1], [2, 3], [-1.0], 1.0, "expected 2 values"),
        ([1], [2], [-1.0], float("inf"), "advantage"),
    ],
)
def test_datum_from_sample_rejects_what_cannot_train(prompt, tokens, logprobs, advantage, match):
    sample = types.SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason="length")
    with pytest.raises(InputError, match=match):
        datum_from_sample(prompt, sample, advantage)


# ---- the tinker client's datums (docs/rl.md, "Over HTTP") -------------------------------------------------
def _recorded_sample() -> tuple[list[int], types.SampledSequence]:
    prompt = [256, 51, 50, 63]
    return prompt, types.SampledSequence(tokens=[55, 56, 257], logprobs=[-0.5, -1.0, -2.0], stop_reason="stop",
                                         sequence_id="seq-abc:0")


def _plain(datum) -> dict:
    """A datum's fields as plain values, for ours and the tinker client's alike."""
    return {"model_input": [int(t) for t in datum.model_input.to_ints()],
            "inputs": {k: v.to_numpy().tolist() for k, v in datum.loss_fn_inputs.items()},
            "spans": [[(type(s).__name__, s.sequence_id, s.offset, s.length) for s in spans or ()]
                      for spans in (datum.model_input_spans, datum.loss_fn_input_spans)]}


def test_tinker_datum_from_sample_is_the_tinker_form_of_datum_from_sample():
    tt = pytest.importorskip("tinker").types
    from skyrl_sdk.rl import tinker_datum_from_sample, to_tinker

    prompt, sample = _recorded_sample()
    ours = datum_from_sample(prompt, sample, 0.75, weights=True)
    theirs = tinker_datum_from_sample(prompt, sample, 0.75, weights=True)
    assert isinstance(theirs, tt.Datum) and _plain(theirs) == _plain(ours)
    assert _plain(theirs)["spans"] == [
        [("PromptProvenanceSpan", "seq-abc:0", 0, 4), ("SampledProvenanceSpan", "seq-abc:0", 0, 2)],
        [("PromptProvenanceSpan", "seq-abc:0", 1, 3), ("SampledProvenanceSpan", "seq-abc:0", 0, 3)]]
    assert theirs.loss_fn_inputs["target_tokens"].dtype == "int64"
    # a tinker ModelInput prompt and a tinker SampledSequence give the same datum
    tinker_sample = tt.SampledSequence(stop_reason="stop", sequence_id="seq-abc:0", _tokens_list=list(sample.tokens),
                                       _logprobs_list=list(sample.logprobs))
    assert _plain(tinker_datum_from_sample(tt.ModelInput.from_ints(prompt), tinker_sample, 0.75, weights=True)) \
        == _plain(ours)
    # back through the server's input path: the same datum
    from skyrl_sdk.inputs.coerce import data_from_any

    assert _plain(data_from_any([to_tinker(ours)])[0]) == _plain(ours)
    unrecorded = types.SampledSequence(tokens=[55], logprobs=[-0.5], stop_reason="length")
    assert tinker_datum_from_sample(prompt, unrecorded, 1.0).model_input_spans is None


def test_tinker_datum_from_sample_is_the_datum_tinker_cookbook_builds():
    """tinker-cookbook's RL loops (``trajectory_to_data``) build their stable_reinforce datums
    with provenance; for the same one-turn sample the helper gives the same datum."""
    pytest.importorskip("tinker")
    data_processing = pytest.importorskip("tinker_cookbook.rl.data_processing",
                                          reason="pip install --no-deps tinker-cookbook (see docs/server.md)")
    import tinker
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.types import Trajectory, Transition

    from skyrl_sdk.rl import tinker_datum_from_sample

    prompt, sample = _recorded_sample()
    action = TokensWithLogprobs(tokens=list(sample.tokens), maybe_logprobs=list(sample.logprobs),
                                sequence_id=sample.sequence_id)
    trajectory = Trajectory(transitions=[Transition(ob=tinker.ModelInput.from_ints(prompt), ac=action, reward=1.0,
                                                    episode_done=True)], final_ob=tinker.ModelInput.empty())
    (cookbook,) = data_processing.trajectory_to_data(trajectory, 0.75)
    ours = _plain(tinker_datum_from_sample(prompt, sample, 0.75, weights=True))
    theirs = _plain(cookbook)
    theirs["inputs"]["weights"] = theirs["inputs"].pop("mask")  # the cookbook's name for the completion mask
    assert ours == theirs
