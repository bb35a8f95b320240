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
