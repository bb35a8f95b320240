"""The sampler contract: what serves ``Backend.sample``, and the narrow view of the model it gets.

It sits in the plugins layer so the registry can hold sampler plugins to it when they
register; ``skyrl_sdk.sampling`` re-exports it beside the decode loop.

A :class:`Sampler` is built once per Backend, on its first ``sample``, with a
:class:`WeightsSource` (never the engine) and its ``sampler_config``; each call hands it one
:class:`~skyrl_sdk.types.SampleRequest` (re-exported here), the object the caller's arguments
became. The source gives what
decoding needs and nothing else: the model's facts (tokenizer, config, EOS / padding ids,
LoRA config, compute dtype), the weights (a Hugging Face directory to start from, the
current tensors in memory, a LoRA adapter's tensors), a :attr:`~WeightsSource.version` that
moves whenever the weights change (the engine's own count, ``Engine.weights_version``), and,
for our own decode loop, a :class:`skyrl_sdk.sampling.Decoder` where the weights live. The built-in
``transformers`` sampler runs that decoder; an inference engine (the ``vllm`` plugin) loads the weights into its own
engine and reloads what changed when the version moves.

Both classes are ABCs: a subclass missing an abstract method fails when it is instantiated,
with ``TypeError`` naming the method, and the registry refuses such a sampler class when its
plugin registers it.
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import InputError, PluginError
from ..types import LoraConfig, SampleOutput, SampleRequest
from .weight_push import PushLayout, PushTarget


@attrs.frozen
class AdapterWeights:
    """A LoRA adapter as peft saves it: ``adapter_config.json``'s fields and the tensors of
    ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``, ...)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class WeightsSource(ABC):
    """The model a sampler samples from, narrowed to what decoding needs (see the module docstring).

    Engines build one (``Engine.weights_source()``) and give it their :attr:`version`.
    Attributes every source sets: ``tokenizer``, ``hf_config`` (the transformers config),
    ``eos_token_id``, ``pad_token_id``, ``lora`` (a :class:`~skyrl_sdk.types.LoraConfig` or
    None), ``dtype`` (the compute dtype's name, ``"float32"`` or ``"bfloat16"``) and ``device``
    (where the weights live).
    """

    tokenizer: Any = None
    hf_config: Any = None
    eos_token_id: int | None = None
    pad_token_id: int = 0
    lora: LoraConfig | None = None
    dtype: str = "float32"
    device: torch.device = torch.device("cpu")
    #: the name the Backend was built with (a hub id, a directory, ``"tiny"``): for messages
    model_name: str = ""
    #: whether :meth:`base_weights` yields this process's live tensors (no copy, no file): a
    #: sampler in this process may read them directly instead of having them pushed
    in_process: bool = False

    @property
    @abstractmethod
    def version(self) -> int:
        """The engine's weights version (``Engine.weights_version``, the one count of weight
        changes): it moves, never back, whenever the weights change, so a sampler holding a copy
        of them reloads when it differs from the version it loaded."""

    @property
    def base_key(self) -> Hashable:
        """Sources with equal keys have the same base weights, which never change: the LoRA
        adapters of one shared base (``skyrl_sdk.SharedBase``, the server's LoRA clients). A
        sampler may then serve them all from one copy of the base. By default, unique."""
        return self

    # ---- the weights ----------------------------------------------------------------------
    @abstractmethod
    def export_base(self, directory: Path) -> None:
        """Write a Hugging Face model directory (config, safetensors, tokenizer) into the existing
        empty ``directory``: the base weights of a LoRA model (no adapter merged), else the
        current weights, in the compute dtype. What an inference engine starts from."""

    def base_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors :meth:`export_base` writes, by their Hugging Face names, current values:
        what a sampler of a full fine-tuning model reloads after the version moved. In-process
        engines yield their live tensors (read them, do not keep or change them); this default
        goes through a temporary directory."""
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(prefix="skyrl-weights-") as tmp:
            self.export_base(Path(tmp))
            for file in sorted(Path(tmp).glob("*.safetensors")):
                yield from load_file(str(file)).items()

    def adapter_weights(self) -> AdapterWeights:
        """The LoRA adapter's current tensors (copies: the caller may keep them), or
        ``InputError`` for a model without LoRA."""
        raise InputError(f"model {self.model_name}: no LoRA adapter to read (this Backend trains all weights)")

    # ---- pushing the weights to another place (skyrl_sdk.plugins.weight_push) --------------
    def push_layout(self, dtype: str, gathered: bool = False) -> PushLayout:
        """What :meth:`push_weights` sends of :meth:`export_base`'s tensors (tied ones once), its
        floating tensors in ``dtype``, and which rows each trainer rank holds (``gathered``: rank 0
        sends each tensor whole, for a transport with one sender); sends nothing."""
        raise InputError(f"model {self.model_name}: this engine cannot push its weights; use a sampler that reads "
                         f"them (sampler='transformers', or the vllm sampler with placement 'local')")

    def push_weights(self, target: PushTarget, layout: PushLayout) -> None:
        """Run ``target``'s sender where the weights live, on every trainer rank, with that rank's
        rows of ``layout``'s tensors (current values); return when every rank has sent."""
        raise InputError(f"model {self.model_name}: this engine cannot push its weights")

    # ---- our decode loop ------------------------------------------------------------------
    @abstractmethod
    def decoder(self) -> Any:
        """A :class:`skyrl_sdk.sampling.Decoder` on the weights where they live: the built-in
        sampler runs our decode loop through it."""


class Sampler(ABC):
    """What serves ``Backend.sample`` (registered with ``skyrl_sdk_register_samplers``).

    The Backend builds it on its first ``sample`` as ``factory(source=..., config=...)`` and
    calls :meth:`close` from ``Backend.close()``. Subclasses implement :meth:`sample`;
    ``config`` is a copy of the Backend's ``sampler_config`` (refuse unknown keys by name).
    """

    #: the name the sampler is registered under (messages, ``get_info().sampler``)
    name: str = "custom"
    #: True: the sampler samples from a copy of the weights of its own (an inference engine), so
    #: the trainer's may wait in host memory while it samples (``engine_config
    #: ["offload_while_sampling"]``); False: it decodes on the trainer's own module
    own_weights: bool = False
    #: True when the sampler computes on devices of its own, apart from the trainer's (vLLM engines
    #: placed by Ray): ``Backend.sample`` then brings its weights up to date holding the Backend's
    #: lock (:meth:`sync_weights`, only when :meth:`weights_current` says they are not) and samples
    #: without it, so a sample call never waits for a training call that does not change them.
    #: Such a sampler's :meth:`sample` reads no weights itself.
    runs_apart: bool = False

    def __init__(self, *, source: WeightsSource, config: Mapping[str, Any]) -> None:
        self.source = source
        self.config = dict(config)

    @abstractmethod
    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        """One :class:`~skyrl_sdk.types.SampleOutput` per prompt, ``request.num_samples``
        sequences each, from the source's current weights (see docs/engines.md, Samplers)."""

    def weights_current(self) -> bool:
        """Whether the sampler holds the source's current weights (samplers that read them where
        they live always do)."""
        return True

    def sync_weights(self) -> None:  # noqa: B027  (optional: most samplers read the weights where they live)
        """Bring the sampler's copy of the weights to the source's current version (the Backend
        calls it holding its lock, when :attr:`runs_apart`)."""

    def describe(self) -> str:
        """One line for ``get_info().sampler``, the server's log and the console: the name, and
        what a user should know of this instance (an engine version, a memory setting)."""
        return self.name

    def before_training(self) -> None:  # noqa: B027  (optional: most samplers hold no device memory)
        """The trainer is about to compute (``forward`` / ``forward_backward`` / ``optim_step``, or
        ``load_state``) after this sampler sampled: a sampler holding device memory of
        its own may free it now (the ``vllm`` sampler sleeps) and take it back at its next
        :meth:`sample`. The Backend calls it once per turn, not before every training call."""

    def refuse(self, request: SampleRequest, supported: Sequence[str]) -> None:
        """``InputError`` naming every option ``request`` sets that is not in ``supported``
        (option names as :meth:`SampleRequest.options_set` gives them)."""
        unsupported = [n for n in request.options_set() if n not in supported]
        if unsupported:
            raise InputError(f"the {self.name!r} sampler cannot serve {', '.join(unsupported)}; of the "
                             f"options it serves {', '.join(supported) or 'none'}")

    def close(self) -> None:  # noqa: B027  (optional: most samplers hold nothing to free)
        """Free what the sampler holds; called once or more (must be idempotent)."""


def check_sampler(obj: Any, name: str) -> Sampler:
    """``obj`` if it is a :class:`Sampler`, else ``PluginError`` naming the sampler ``name``
    (what a registered factory that is not a Sampler class returned)."""
    if not isinstance(obj, Sampler):
        raise PluginError(f"sampler {name!r}: its factory returned {type(obj).__qualname__}, not a "
                          f"skyrl_sdk.sampling.Sampler (docs/engines.md, Samplers)")
    return obj
