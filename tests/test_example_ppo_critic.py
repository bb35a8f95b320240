"""examples/ppo_critic.py runs end to end in its smoke mode (policy, critic, frozen reference)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ppo_critic.py"


def load_example():
    spec = importlib.util.spec_from_file_location("ppo_critic_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gae_matches_the_recursion():
    import numpy as np

    example = load_example()
    rewards = np.array([0.0, 0.0, 1.0], np.float32)
    values = np.array([0.5, 0.25, -0.5], np.float32)
    adv, ret = example.gae(rewards, values, gamma=0.9, lam=0.8)
    d2 = 1.0 - (-0.5)
    d1 = 0.0 + 0.9 * -0.5 - 0.25
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    np.testing.assert_allclose(adv, [a0, a1, a2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret, adv + values, rtol=1e-6, atol=1e-6)


def test_ppo_critic_example_smoke(capsys):
    history = load_example().main(["--smoke"])
    assert [h["step"] for h in history] == [0, 1]
    for h in history:
        assert all(math.isfinite(h[k]) for k in ("reward", "policy_loss", "kl_loss", "critic_loss"))
    assert history[0]["kl_loss"] == 0.0  # the policy starts as the frozen reference
    assert history[1]["kl_loss"] > 0.0  # one update later it has moved away from it
    assert capsys.readouterr().out.count('"step"') == 2
