"""Our decode loop where a model's weights live: what the built-in ``transformers`` sampler runs.

A :class:`~skyrl_sdk.plugins.samplers.WeightsSource` hands out a :class:`Decoder`. An
in-process engine's is a :class:`ModuleDecoder` on its own module; an engine whose weights
live in other processes (the FSDP plugin's) sends the request there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from ..types import SampleOutput, SampleRequest


class Decoder(ABC):
    """Runs our decode loop on the current weights."""

    @abstractmethod
    def generate(self, request: SampleRequest) -> list[SampleOutput]:
        """One ``SampleOutput`` per prompt (what ``Sampler.sample`` returns)."""


def _no_sharing() -> AbstractContextManager[int | None]:
    return nullcontext(None)


@attrs.frozen(eq=False)
class ModuleDecoder(Decoder):
    """:func:`skyrl_sdk.sampling.generate` on ``module``, in this process.

    ``session()`` is entered around each call: the adapter's turn on a shared base (which
    reloads an offloaded adapter) and the compute precision ``forward`` runs in. It yields the
    engine's prefix-sharing threshold at that moment (None: off), so samples of a bfloat16
    model are rescored on the rows ``forward`` would share.
    """

    module: torch.nn.Module
    tokenizer: Any
    device: torch.device
    eos_token_id: int | None
    pad_token_id: int
    session: Callable[[], AbstractContextManager[int | None]] = _no_sharing

    def generate(self, request: SampleRequest) -> list[SampleOutput]:
        from .decode import generate

        with self.session() as prefix_min_tokens:
            return generate(self.module, self.tokenizer, request, device=self.device, eos_token_id=self.eos_token_id,
                            pad_token_id=self.pad_token_id, prefix_min_tokens=prefix_min_tokens)
