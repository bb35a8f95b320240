"""Generation from the current weights: our own KV-cached decode loop (see ``decode``).

Returned logprobs are those of the sampled tokens under the model's own distribution
(temperature 1, no top-k / top-p), i.e. what ``forward`` reports for the same tokens, so
they can be fed back as the ``logprobs`` input of RL losses. Stop rules follow Tinker
(``stops``); draws use a per-request ``torch.Generator`` (``draw``). ``plugin`` registers
the built-in ``transformers`` sampler; ``generate`` loads lazily (plugin loading stays light).
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate"]


def __getattr__(name: str) -> Any:
    if name == "generate":
        from .decode import generate

        return generate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
