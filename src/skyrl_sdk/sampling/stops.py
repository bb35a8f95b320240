"""When a sampled sequence ends: Tinker's stop rules.

- ``stop=None`` (the default): the model's EOS token ends a sequence (implicit EOS stopping).
- ``stop=[]``: nothing ends a sequence early, not even EOS; it runs to ``max_tokens``.
- ``stop=[ids or strings]``: exactly these; EOS stops only when its id is in the list.

The token that ends a sequence is part of it: a stop token is the last token returned, and
a stop string ends the sequence after the token whose text completes it (the string is not
cut out of the tokens). ``stop_reason`` is ``"stop"``, else ``"length"`` at ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..errors import InputError
from ..types import SamplingParams

#: Upper bound of tokens one character can take (a byte-level BPE spends up to 4 on it).
_TOKENS_PER_CHAR = 4


@attrs.frozen
class StopRules:
    """The stop token ids and strings of one request."""

    token_ids: tuple[int, ...]
    strings: tuple[str, ...]

    @classmethod
    def of(cls, params: SamplingParams, eos_token_id: int | None, tokenizer: Any = None) -> StopRules:
        if params.stop is None:
            return cls(token_ids=() if eos_token_id is None else (int(eos_token_id),), strings=())
        strings = tuple(s for s in params.stop if isinstance(s, str))
        if strings and tokenizer is None:
            raise InputError("SamplingParams.stop: stop strings need a tokenizer, and this model has none; "
                             "pass stop token ids instead")
        ids = tuple(sorted({int(s) for s in params.stop if not isinstance(s, str)}))
        return cls(token_ids=ids, strings=strings)

    def token_tensor(self, device: torch.device) -> torch.Tensor | None:
        return torch.tensor(self.token_ids, dtype=torch.long, device=device) if self.token_ids else None


class StopStringWatcher:
    """Finds, step by step, the rows whose text now contains a stop string.

    Only the last few tokens are decoded each step (enough to hold the longest stop string),
    so the cost per step does not grow with the sequence: an earlier occurrence was already
    caught at the step that completed it.
    """

    def __init__(self, tokenizer: Any, strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.strings = tuple(strings)
        self.window = _TOKENS_PER_CHAR * max(len(s) for s in self.strings) + 1

    def hits(self, sequences: Sequence[Sequence[int]]) -> list[bool]:
        texts = self.tokenizer.batch_decode([list(seq[-self.window:]) for seq in sequences])
        return [any(s in text for s in self.strings) for text in texts]
