"""When a colocated vLLM engine sleeps and wakes (``sampler_config["sleep_level"]``).

An RL step samples a batch (often in several ``sample`` calls: one per group, or a server's
clients one after another), then trains on it. The engine sleeps once the trainer is about to
compute (``Sampler.before_training``, which the Backend calls before the first ``forward`` /
``forward_backward`` / ``optim_step`` after sampling) and wakes once, at the first ``sample``
after that: the samples of one step share one wake, and the trainer's calls one sleep. (It used
to sleep after every ``sample`` call and wake before the next, paying both per call.)

Level 1 moves vLLM's weights to host memory and drops its KV cache; level 2 drops the weights
too (the next sync reloads them: full fine-tuning only). The policy is this small class, apart
from vLLM, so it is tested on machines where vLLM has no sleep mode (its CPU backend); the
calls it makes are ``LLM.sleep(level=...)`` and ``LLM.wake_up()``.
"""

from __future__ import annotations

from typing import Any


class SleepMode:
    """One engine's sleep state and the count of its sleeps and wakes."""

    def __init__(self, level: int) -> None:
        self.level = level
        #: the level vLLM sleeps at now (0: awake)
        self.asleep = 0
        self.sleeps = 0
        self.wakes = 0

    def wake(self, llm: Any) -> bool:
        """Before sampling: wake ``llm`` if it sleeps. True when its weights were dropped (level
        2): the caller must load them again before it samples."""
        level, self.asleep = self.asleep, 0
        if level:
            llm.wake_up()
            self.wakes += 1
        return level == 2

    def sleep(self, llm: Any) -> bool:
        """Before the trainer computes: put ``llm`` to sleep at the configured level (nothing at
        level 0, or when it sleeps already). True when it went to sleep now."""
        if not self.level or self.asleep:
            return False
        llm.sleep(level=self.level)
        self.asleep = self.level
        self.sleeps += 1
        return True
