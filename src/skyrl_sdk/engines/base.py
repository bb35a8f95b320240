"""The engine contract the Backend drives, as one small base class, and the assembly every
in-process engine shares.

An engine owns a model and its optimizer. The Backend validates and converts everything
*before* calling an engine, so an engine may assume well-formed input. To write one,
subclass :class:`Engine`: set :attr:`~Engine.info` and :attr:`~Engine.tokenizer` in
``__init__`` and implement :meth:`~Engine.run`, :meth:`~Engine.optim_step` and
:meth:`~Engine.zero_grad` (abstract: a subclass without them fails at construction);
saving, exporting and sampling (:meth:`~Engine.weights_source`, what a sampler reads) are
optional (the defaults refuse with a message naming the engine). An engine that runs a model
in its own process builds it with :func:`scoring_model`, :func:`runner_options` and
:meth:`EngineInfo.of`, as the local, shared-base and FSDP rank engines do.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from ..errors import InputError
from ..losses.base import scores_key  # noqa: F401  (part of the engine API)
from ..losses.resolve import ResolvedLoss
from ..models.images import ImageInputs, ImageLimits
from ..models.loading import LoadedModel, load_config, max_positions
from ..models.scoring import ScoringModel, count_parameters
from ..models.vlm import is_vision_language
from ..plugins.samplers import WeightsSource
from ..types import AdamParams, Datum, LoraConfig
from .config import EngineConfig
from .turns import Steps, one_step


@attrs.frozen(eq=False)
class EngineResult:
    """Per-datum outputs (caller's order; name -> numpy array) and metric state."""

    outputs: list[dict[str, np.ndarray]]
    metric_state: dict[str, tuple[float, float]]


@attrs.frozen
class EngineInfo:
    """What ``Backend.get_info()`` reports about an engine's model."""

    model_name: str
    architecture: str
    vocab_size: int
    tokenizer_dir: str | None
    num_parameters: int
    num_trainable_parameters: int
    eos_token_id: int | None = None
    #: the longest sequence the model accepts (``max_position_embeddings``; None: no limit known)
    max_positions: int | None = None
    #: whether datums sharing a head are computed with it once, and why not (a status line; an
    #: in-process engine answers live: ``Engine.prefix_sharing``)
    prefix_sharing: str = "off"

    @classmethod
    def of(cls, loaded: LoadedModel, module: torch.nn.Module | None = None, *,
           counts: tuple[int, int] | None = None) -> EngineInfo:
        """The info of ``loaded``; parameters are counted on ``module`` (default: the loaded
        module), or given as ``counts = (total, trainable)``."""
        total, trainable = counts if counts is not None else count_parameters(
            loaded.module if module is None else module)
        return cls(model_name=loaded.name, architecture=loaded.architecture, vocab_size=loaded.vocab_size,
                   tokenizer_dir=loaded.tokenizer_dir, num_parameters=total, num_trainable_parameters=trainable,
                   eos_token_id=loaded.eos_token_id, max_positions=max_positions(loaded.config))


class Engine(abc.ABC):
    """Base class of execution engines (see the module docstring).

    An abstract base class: a subclass that lacks :meth:`run`, :meth:`optim_step` or
    :meth:`zero_grad` cannot be instantiated (``TypeError`` naming the missing methods), so a
    broken engine fails when the Backend builds it, not at its first call.

    Paths given to the save methods are fresh temporary directories that the Backend renames
    into place once the engine returns. Engines are registered by name through the
    ``skyrl_sdk_register_engines`` hook; the Backend calls the registered factory (usually the
    class) with ``model``, ``role``, ``lora``, ``seed`` and ``engine_config`` keywords.
    """

    #: The name the engine is registered under (used in messages and saved states).
    name = "custom"
    info: EngineInfo
    tokenizer: Any = None
    #: A vision-language model's image processor and image limits (:func:`image_inputs`); None:
    #: the model reads no images, and the Backend refuses image chunks by name.
    images: ImageInputs | None = None
    _weights_version = 0

    @property
    def weights_version(self) -> int:
        """How many times this engine's weights changed: the one version of them. Samplers read
        it through :meth:`weights_source` (a copy of the weights reloads when it moved) and the
        server pins snapshots by it. :meth:`weights_changed` moves it."""
        return self._weights_version

    def weights_changed(self) -> None:
        """Move :attr:`weights_version` on (never back). The Backend calls it after each call of
        its that changed the weights (an ``optim_step`` not skipped, ``load_state``); an engine
        calls it itself where it changes them otherwise (:meth:`load_trainable`)."""
        self._weights_version += 1

    @property
    def prefix_sharing(self) -> str:
        """Whether datums sharing a head are computed with it once, and why not, as of now
        (``get_info().prefix_sharing``): ``info.prefix_sharing``, or what the engine knows live
        (an in-process runner's self-test runs at its first call)."""
        return self.info.prefix_sharing

    @abc.abstractmethod
    def run(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool) -> EngineResult:
        """Score ``data`` with ``loss``; with ``backward`` add the gradient of the summed loss.

        A backward call that raises leaves the pending gradients as they were (``ModelRunner``
        keeps them with :mod:`.call_grads`) or says it dropped them (``call_grads.DROPPED`` on the
        exception, so the Backend resets its call count). An engine whose ``run`` also takes a
        ``keep_grads_on_error`` keyword (bool) lets a caller choose that for one call
        (``Backend.forward_backward(..., keep_grads_on_error=False)``); the Backend passes it
        only when the caller set it."""

    def run_steps(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool,
                  keep_grads_on_error: bool | None = None) -> Steps[EngineResult]:
        """:meth:`run` as a stepped call (:mod:`.turns`): a generator that yields at each micro-batch
        boundary and returns :meth:`run`'s result, so a scheduler (the server's executor) gives
        other calls the device between micro-batches without running them inside this one. The
        default is one step (an engine that computes in other processes cannot pause); an
        in-process engine returns its runner's :meth:`~.runner.ModelRunner.steps`.
        ``keep_grads_on_error`` is passed on to :meth:`run` when set (the Backend sets it only for
        an engine whose ``run`` takes it)."""
        options = {} if keep_grads_on_error is None else {"keep_grads_on_error": keep_grads_on_error}
        return (yield from one_step(self.run, data, loss, backward=backward, **options))

    @abc.abstractmethod
    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale pending gradients, clip, AdamW-step, clear gradients; return metrics."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop pending gradients."""

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write weights + optimizer state into ``directory``; return metadata to record."""
        raise self.unsupported("save a training state")

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        """Load what :meth:`save_state` wrote (weights always, optimizer when asked)."""
        raise self.unsupported("load a training state")

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        """Write a Hugging Face model directory (config, safetensors, tokenizer)."""
        raise self.unsupported("export weights")

    def copy_trainable(self, max_bytes: int) -> dict[str, torch.Tensor] | None:
        """CPU copies of the tensors the optimizer trains (a LoRA model's adapter, else every
        weight), by name: what :meth:`load_trainable` of an engine built alike needs to hold these
        weights. None when they come to more than ``max_bytes`` (nothing is copied then) or the
        engine keeps no copies in memory (the default): the server then snapshots through
        ``save_state`` / ``export_weights``, on disk."""
        return None

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (:meth:`copy_trainable` of an engine built alike) into this engine's
        trained tensors, and move :attr:`weights_version`."""
        raise self.unsupported("load trained tensors from memory")

    def weights_source(self) -> WeightsSource:
        """The current weights as a sampler sees them (``skyrl_sdk.sampling.WeightsSource``): built
        once per Backend, on its first ``sample``. In-process engines return
        :class:`~.weights.EngineWeights`."""
        raise self.unsupported("sample")

    def peak_flops(self) -> float | None:
        """FLOP/s of the devices this engine computes on at their peak, in its compute dtype: the
        denominator of the ``mfu`` metric (``engines.throughput.peak_flops``). None: unknown (no
        MFU is reported)."""
        return None

    def offload_to_host(self) -> bool:
        """Before a sampler with its own copy of the weights samples: move the trainer's
        parameters, gradients and optimizer state to host memory, if this engine was asked to
        (``engine_config["offload_while_sampling"]``). True when they moved. Default: never."""
        return False

    def reload_to_device(self) -> None:  # noqa: B027 (optional: nothing was offloaded by default)
        """Bring back what :meth:`offload_to_host` moved (a no-op when nothing did); the Backend
        calls it before every call that computes (``forward``, ``forward_backward``,
        ``optim_step``) or loads a state. Saves and exports read the tensors where they are."""

    def close(self) -> None:  # noqa: B027 (optional: nothing to free by default)
        """Free memory and processes; called once or more (must be idempotent)."""

    def unsupported(self, what: str) -> InputError:
        """The error of an optional feature this engine does not have."""
        return InputError(f"engine {self.name!r} cannot {what}")


class EngineFactory(Protocol):
    """What builds a Backend's engine: a registered engine's factory (usually the Engine class),
    or one passed as ``Backend(engine=...)`` (``skyrl_sdk.SharedBase``'s)."""

    def __call__(self, *, model: str, role: str, lora: LoraConfig | None, seed: int,
                 engine_config: dict[str, Any]) -> Engine: ...


def scoring_model(module: torch.nn.Module, role: str, config: EngineConfig,
                  cls: type[ScoringModel] = ScoringModel) -> ScoringModel:
    """The module an engine runs: ``module``'s backbone and scoring head, chunked as configured
    (``cls`` lets a parallel engine use its own subclass)."""
    scoring = cls(module, role)
    scoring.chunk_elements = config.logprob_chunk_elements
    return scoring


def image_inputs(model: str, config: EngineConfig) -> ImageInputs | None:
    """``model``'s image processor (from its directory; no weights are read) with ``config``'s
    image limits, for a vision-language model; None for a text model. An engine sets its
    :attr:`Engine.images` with it; the Backend then reads every call's images through it."""
    hf_config, directory = load_config(model)
    if not is_vision_language(hf_config):
        return None
    limits = ImageLimits(max_pixels=config.max_image_pixels, max_tokens_per_datum=config.max_image_tokens_per_datum,
                         max_tokens_per_call=config.max_image_tokens_per_call,
                         max_pixels_per_call=config.max_image_pixels_per_call, max_jpeg_scans=config.max_jpeg_scans,
                         max_decode_s=config.max_image_decode_s)
    return ImageInputs.load(directory, hf_config, limits)


def runner_options(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of a :class:`~.runner.ModelRunner` for ``config``: micro-batching,
    padding id, prefix sharing, and autocast to the compute dtype under mixed precision."""
    return dict(device=device, micro_batch_tokens=config.micro_batch_tokens, batching=config.batching,
                pad_id=loaded.pad_token_id,
                # None: on where the attention kernel takes it (the runner's status says why not)
                prefix_min_tokens=None if config.prefix_sharing is False else config.prefix_sharing_min_tokens,
                compute_float32=config.dtype == "float32",
                autocast_dtype=config.torch_dtype if config.mixed_precision else None,
                keep_grads_on_error=config.keep_grads_on_error)
