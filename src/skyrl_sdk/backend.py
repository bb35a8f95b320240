"""The Backend facade: validate -> convert -> engine -> typed outputs.

Tinker semantics: losses SUM over tokens, gradients of successive ``forward_backward``
calls add up until ``optim_step``, ``target_tokens`` are scored exactly as sent, every
``AdamParams`` field is honoured. Bad input raises a ``ValueError`` subclass before any
compute and leaves no trace.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .builtin_plugins import get_registry
from .engines import call_grads
from .engines.base import Engine, EngineFactory
from .engines.call_slot import CallSlot
from .engines.state import read_state_metadata
from .engines.throughput import CallClock
from .engines.turns import Steps, run_to_end, timed
from .errors import CriticExportWarning, InputError
from .inputs.coerce import adam_params_from_any, lora_config_from_any
from .inputs.sample import sample_request_from_any
from .losses.calls import CallModel, prepare_call, prepare_sample
from .losses.metrics import MetricAccumulator
from .losses.resolve import ResolvedLoss
from .losses.run import add_prepared_inputs
from .losses.stability import Records, SequenceRecords
from .models.checkpoint import atomic_directory, write_json
from .models.value_head import critic_export_note, write_critic_card
from .plugins.samplers import Sampler, check_sampler
from .types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadStateOutput,
    ModelInfo,
    OptimStepOutput,
    SampleOutput,
    SampleRequest,
    SamplingParams,
    SaveStateOutput,
    SaveWeightsForSamplerOutput,
    TensorData,
)
from .version import __version__

logger = logging.getLogger(__name__)

METADATA_FILE = "skyrl_state.json"
STATE_FORMAT = 1
LOSS_FN_OUTPUT_TYPE = "ArrayRecord"


class Backend:
    """A trainable model behind Tinker's API, in-process.

    >>> with Backend(model="tiny") as backend:  # doctest: +SKIP
    ...     out = backend.forward_backward(data, loss_fn="cross_entropy")
    ...     backend.optim_step(types.AdamParams(learning_rate=1e-4))
    """

    def __init__(
        self,
        model: str = "tiny",
        engine: str | EngineFactory = "local",
        engine_config: Mapping[str, Any] | None = None,
        lora: Any = None,
        role: str = "policy",
        dialect: str = "tinker",
        seed: int = 0,
        grad_accumulation: str = "sum",
        sampler: str = "transformers",
        sampler_config: Mapping[str, Any] | None = None,
    ) -> None:
        if role not in ("policy", "critic"):
            raise InputError(f"role must be 'policy' or 'critic', got {role!r}")
        if grad_accumulation not in ("sum", "mean"):
            raise InputError(f"grad_accumulation must be 'sum' or 'mean', got {grad_accumulation!r}")
        registry = get_registry()
        registry.dialect_spec(dialect)
        # ``engine`` is a registered name, or (skyrl_sdk.SharedBase) a factory building the engine itself
        if not isinstance(engine, str) and not callable(engine):
            raise InputError(f"engine: expected an engine name, got {type(engine).__name__}")
        if isinstance(engine, str):
            registry.engine_spec(engine)
        registry.sampler_spec(sampler)
        if sampler_config is not None and not isinstance(sampler_config, Mapping):
            raise InputError(f"sampler_config: expected a mapping, got {type(sampler_config).__name__}")
        self.sampler_name = sampler
        self._sampler_config = dict(sampler_config or {})
        self._sampler: Sampler | None = None  # built on the first sample(): a sampler may hold a second model
        self._sampled = False  # the sampler sampled since the trainer last computed (it holds the device)
        self.model_name = str(model)
        self.role = role
        self.dialect = dialect
        self.seed = seed
        self.lora = lora_config_from_any(lora)
        self.grad_accumulation = grad_accumulation
        self.engine_name = engine if isinstance(engine, str) else str(getattr(engine, "engine_name", "custom"))
        #: one call at a time (engines/call_slot.py): a call while a stepped call is paused is refused
        self._slot = CallSlot(f"the Backend of {self.model_name!r}")
        #: sequences sampled with ``record_stability_info=True``, which provenance names
        #: (``stable_reinforce``); replaceable by a store shared with other samplers (the server's session)
        self.sequences: Records = SequenceRecords()
        self._calls_since_step = 0
        self._closed = False
        t0 = time.perf_counter()
        build: EngineFactory = registry.engines[engine].factory if isinstance(engine, str) else engine
        self.engine: Engine = build(
            model=self.model_name, role=role, lora=self.lora, seed=seed, engine_config=dict(engine_config or {})
        )
        #: times each call: the throughput metrics of its output (engines/throughput.py)
        self.clock = CallClock(self.engine, lora=self.lora is not None)
        logger.info("Backend ready: model=%s engine=%s role=%s lora=%s (%.1fs)",
                    self.model_name, self.engine_name, role, self.lora, time.perf_counter() - t0)

    # ---- context manager --------------------------------------------------------------
    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the engine (and the sampler); waits for a call running or paused on another thread."""
        with self._slot.call("close", wait_if_paused=True):
            if not self._closed:
                if self._sampler is not None:
                    self._sampler.close()
                self.engine.close()
                self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (its engine's memory is freed)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise InputError("this Backend is closed")

    # ---- compute ----------------------------------------------------------------------
    @property
    def pending_calls(self) -> int:
        """forward_backward calls since the last optim_step (or zero_grad): their gradients add up."""
        return self._calls_since_step

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    def resolve(self, loss_fn: str | None, loss_fn_config: Mapping[str, Any] | None = None) -> ResolvedLoss:
        """Map a loss name and config through this Backend's dialect (validates the config).
        ``None`` is the role's default loss: ``cross_entropy`` (policy) or ``value`` (critic)."""
        if loss_fn is None:
            loss_fn = "value" if self.role == "critic" else "cross_entropy"
        return get_registry().resolve(loss_fn, loss_fn_config, dialect=self.dialect, role=self.role)

    def _prepare(self, data: Sequence[Any], loss_fn: str | None, loss_fn_config: Mapping[str, Any] | None,
                 backward: bool = True) -> Steps[tuple[list[Datum], ResolvedLoss]]:
        """(stepped: a loss's ``prepare`` runs a forward first) A call's datums and loss, checked."""
        resolved = self.resolve(loss_fn, loss_fn_config)
        datums, resolved = yield from prepare_call(data, resolved, self._call_model(), backward=backward,
                                        losses=get_registry().losses)  # checked: nothing computed yet
        if resolved.spec.prepare is not None and not resolved.scores_only:
            prepared = yield from self.engine.run_steps(datums, resolved, backward=False)
            datums = add_prepared_inputs(datums, resolved, prepared.outputs)
        return datums, resolved

    def _call_model(self) -> CallModel:
        """What this Backend's calls are completed and checked against (:mod:`skyrl_sdk.losses.calls`)."""
        info = self.engine.info
        return CallModel(name=self.model_name, vocab_size=info.vocab_size, max_positions=info.max_positions,
                         images=self.engine.images, sequences=self.sequences)

    def _run_steps(self, datums: list[Datum], resolved: ResolvedLoss, *, backward: bool,
                   **options: Any) -> Steps[ForwardBackwardOutput]:
        """(holding the slot) The engine's stepped call as a ``ForwardBackwardOutput``, timed over
        its own steps (not the pauses in which a scheduler ran other calls)."""
        self._training_turn()
        seconds = [0.0]
        result = yield from timed(self.engine.run_steps(datums, resolved, backward=backward, **options), seconds)
        outputs = [{k: TensorData(np.ascontiguousarray(v)) for k, v in o.items()} for o in result.outputs]
        acc = MetricAccumulator()
        acc.merge([result.metric_state])
        metrics = {**acc.result(), **self.clock.training(datums, seconds[0], backward=backward)}
        return ForwardBackwardOutput(loss_fn_output_type=LOSS_FN_OUTPUT_TYPE, loss_fn_outputs=outputs, metrics=metrics)

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None, *,
        keep_grads_on_error: bool | None = None,
    ) -> ForwardBackwardOutput:
        """Score ``data`` with ``loss_fn`` and add the gradient of the summed loss.

        ``keep_grads_on_error`` chooses for this call whether a failure mid-call keeps the pending
        gradients of earlier calls (at the cost of one more gradient buffer while it runs) or drops
        them all (no extra buffer); None: ``engine_config["keep_grads_on_error"]`` (docs/engines.md)."""
        return run_to_end(self.forward_backward_steps(data, loss_fn, loss_fn_config,
                                                      keep_grads_on_error=keep_grads_on_error))

    def forward_backward_steps(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None, *,
        keep_grads_on_error: bool | None = None,
    ) -> Steps[ForwardBackwardOutput]:
        """:meth:`forward_backward` as a stepped call (``engines.turns``), yielding at micro-batch
        boundaries. It holds the Backend's call slot from its first step to its end: any other call
        on this Backend meanwhile, from any thread, is refused (``CallInProgressError``) while it is
        paused. Drive it to its end, or ``close()`` it, on the thread that started it."""
        body = self._call(data, loss_fn, loss_fn_config, backward=True, keep_grads_on_error=keep_grads_on_error)
        return self._slot.stepped("forward_backward", body)

    def _call(self, data: Sequence[Any], loss_fn: str | None, loss_fn_config: Mapping[str, Any] | None, *,
              backward: bool, keep_grads_on_error: bool | None = None) -> Steps[ForwardBackwardOutput]:
        """(holding the slot) A forward_backward's (``backward``) or forward's stepped call."""
        self._check_open()
        options = call_grads.keep_option(self.engine.run, self.engine_name, keep_grads_on_error) if backward else {}
        datums, resolved = yield from self._prepare(data, loss_fn, loss_fn_config, backward=backward)
        if not backward:
            return (yield from self._run_steps(datums, resolved, backward=False))
        try:
            out = yield from self._run_steps(datums, resolved, backward=True, **options)
        except BaseException as exc:
            kept = call_grads.note_failure(exc, self._calls_since_step)
            self._calls_since_step = self._calls_since_step if kept is None else kept
            raise
        self._calls_since_step += 1
        logger.info("forward_backward(%s): %d datums, %.3fs", resolved.name, len(datums),
                    out.metrics["seconds:sum"])
        return out

    def _training_turn(self) -> None:
        """(holding the slot) Before the trainer computes: a sampler that sampled since gives the
        device back once (vLLM sleeps), then the trainer's offloaded tensors come back."""
        if self._sampled and self._sampler is not None:  # sampled since: a sampler was built
            self._sampled = False
            self._sampler.before_training()
        self.engine.reload_to_device()

    def forward(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardOutput:
        """Like :meth:`forward_backward` but computes no gradient and changes no state.

        The datums may carry inputs of other losses (a policy's ``logprobs``, ``advantages``,
        ``ref_logprobs``): a reference model's ``forward(data, "cross_entropy")`` scores the
        policy's datums as they are. Keys no loss uses are refused as in ``forward_backward``."""
        return run_to_end(self.forward_steps(data, loss_fn, loss_fn_config))

    def forward_steps(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None
    ) -> Steps[ForwardBackwardOutput]:
        """:meth:`forward` as a stepped call, holding the call slot (see :meth:`forward_backward_steps`)."""
        return self._slot.stepped("forward", self._call(data, loss_fn, loss_fn_config, backward=False))

    def optim_step(self, adam_params: Any = None) -> OptimStepOutput:
        """Apply AdamW with exactly ``adam_params`` to the accumulated gradients, then clear them."""
        params = AdamParams() if adam_params is None else adam_params_from_any(adam_params)
        with self._slot.call("optim_step"):
            self._check_open()
            self._training_turn()
            scale = 1.0
            if self.grad_accumulation == "mean" and self._calls_since_step > 1:
                scale = 1.0 / self._calls_since_step
            metrics = self.engine.optim_step(params, scale)
            if not metrics.get("skipped"):  # a skipped step changed nothing
                self.engine.weights_changed()
            metrics["num_forward_backward_calls"] = float(self._calls_since_step)
            self._calls_since_step = 0
            return OptimStepOutput(metrics=metrics)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last optim_step."""
        with self._slot.call("zero_grad"):
            self._check_open()
            self.engine.zero_grad()
            self._calls_since_step = 0

    def sample(
        self,
        prompts: Sequence[Any],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        record_stability_info: bool = False,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Sequence[Any] | None = None,
        prompt_alt_tokens_k: int = 0,
    ) -> list[SampleOutput]:
        """Sample continuations of each prompt (token lists or ModelInputs) from the current weights.

        Tinker's scores from the same pass (docs/reference.md): ``topk_prompt_logprobs=k`` and
        ``topk_sample_logprobs=k`` (the k most likely tokens per prompt / sampled position),
        ``target_prompt_logprobs`` (per prompt, int64 ``[len(prompt) - 1, K]`` token ids to score, -1 for
        none), ``prompt_alt_tokens_k=k`` (k draws per prompt position); ``record_stability_info=True``
        records each sequence in :attr:`sequences` with a ``sequence_id`` (``stable_reinforce``). A score
        the sampler (``sampler=``, built on the first call) does not serve is refused by name."""
        return self.sample_request(sample_request_from_any(
            prompts, sampling_params, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs, record_stability_info=record_stability_info,
            topk_sample_logprobs=topk_sample_logprobs, target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k))

    def sample_request(self, request: SampleRequest) -> list[SampleOutput]:
        """Serve one :class:`~skyrl_sdk.types.SampleRequest` (built by :meth:`sample`, or the server from Tinker's
        JSON): images read, prompts checked, then sampled; ``record_stability_info`` records each sequence in
        :attr:`sequences`, which then carries its ``sequence_id``."""
        self._check_open()
        request = prepare_sample(request, self._call_model())  # images decoded in the caller's thread
        outs, record = self._sample(request), request.record_stability_info  # recorded by token ids (no images)
        return self.sequences.record_outputs(request.prompt_token_ids(), outs) if record else outs

    def _sample(self, request: SampleRequest) -> list[SampleOutput]:
        """A sampler on devices of its own (``runs_apart``) samples outside the slot, its weights synced in it."""
        if (sampler := self._sampler) is None or not sampler.runs_apart:
            with self._slot.call("sample"):
                self._check_open()
                sampler = self._built_sampler()
                if not sampler.runs_apart:
                    if sampler.own_weights:  # engine_config offload_while_sampling: the trainer waits in host memory
                        self.engine.offload_to_host()
                    self._sampled = True
                    return self.clock.timed_sample(sampler, request)
        self._check_open()
        if not sampler.weights_current():  # a paused call on another thread is waited for: training moves no weight
            with self._slot.call("sample (its weights sync)", wait_if_paused=True):
                self._check_open()
                sampler.sync_weights()
        return self.clock.timed_sample(sampler, request)

    @property
    def sampler(self) -> Sampler | None:
        """The sampler serving :meth:`sample` once the first call built it (None before): its
        ``describe()`` says what it is."""
        return self._sampler

    def _built_sampler(self) -> Sampler:
        """(holding the slot) The sampler, built on first use with the engine's weights source."""
        if self._sampler is None:
            factory = get_registry().sampler_spec(self.sampler_name).factory
            if getattr(factory, "own_weights", False):  # its engine starts with the trainer in host memory
                self.engine.offload_to_host()
            source = self.engine.weights_source()
            sampler = check_sampler(factory(source=source, config=dict(self._sampler_config)), self.sampler_name)
            self._sampler = sampler
            logger.info("sampler of %s: %s", self.model_name, sampler.describe())
        return self._sampler

    @property
    def weights_version(self) -> int:
        """The engine's weights version (``Engine.weights_version``): it moves whenever the weights
        change, and the sampler reloads a copy of them when it moved."""
        return self.engine.weights_version

    def weights_changed(self) -> None:
        """Say the engine's weights changed, so the sampler samples the new ones. ``optim_step`` and
        ``load_state`` do it themselves; call it after changing the weights any other way."""
        with self._slot.call("weights_changed"):
            self.engine.weights_changed()

    # ---- saving -----------------------------------------------------------------------
    def save_weights_for_sampler(
        self, path: str | Path, *, merge_lora: bool = True, overwrite: bool = False
    ) -> SaveWeightsForSamplerOutput:
        """Write a Hugging Face model directory (LoRA merged unless ``merge_lora=False``).

        A critic has no lm_head, so its export is no model to sample from: it is written
        (backbone and value head, with a README.md saying so) and a warning says how to load it."""
        with self._slot.call("save_weights_for_sampler"):
            self._check_open()
            with atomic_directory(path, overwrite=overwrite) as tmp:
                self.engine.export_weights(tmp, merge_lora=merge_lora)
                if self.role == "critic":
                    write_critic_card(tmp)
            if self.role == "critic":
                warnings.warn(critic_export_note(path), CriticExportWarning, stacklevel=2)
            return SaveWeightsForSamplerOutput(path=str(Path(path).expanduser().resolve()))

    def _identity(self) -> dict[str, Any]:
        info = self.engine.info
        return {"model_name": self.model_name, "architecture": info.architecture, "vocab_size": info.vocab_size,
                "num_parameters": info.num_parameters, "role": self.role,
                "lora": attrs.asdict(self.lora) if self.lora is not None else None}

    def save_state(self, path: str | Path, *, overwrite: bool = False) -> SaveStateOutput:
        """Weights, optimizer moments and step counts, LoRA config and metadata; atomic, no pickle."""
        with self._slot.call("save_state"):
            self._check_open()
            with atomic_directory(path, overwrite=overwrite) as tmp:
                engine_meta = self.engine.save_state(tmp)
                write_json(tmp / METADATA_FILE, {
                    "format": STATE_FORMAT, "sdk_version": __version__,
                    "engine": self.engine_name,
                    "saved_at": time.time(),
                    "identity": self._identity(),
                    "engine_state": engine_meta,
                })
            return SaveStateOutput(path=str(Path(path).expanduser().resolve()))

    def load_state(self, path: str | Path, optimizer: bool = True) -> LoadStateOutput:
        """Load a :meth:`save_state` directory; refuses a state of another model."""
        directory = Path(path).expanduser()
        with self._slot.call("load_state"):
            self._check_open()
            meta = read_state_metadata(directory, METADATA_FILE, STATE_FORMAT, self._identity())
            self._training_turn()
            self.engine.load_state(directory, meta["engine_state"], optimizer)
            self.engine.weights_changed()
            self._calls_since_step = 0
            return LoadStateOutput(path=str(directory.resolve()), optimizer_loaded=optimizer)

    def image_tokens(self, image: Any) -> int:
        """Positions ``image`` (an ``ImageChunk``, ours or tinker's; PNG or JPEG bytes; a ``(width, height)``)
        takes in this model's sequences: Tinker's ``expected_tokens``, what ``ModelInput.length`` counts. Its
        header is checked against the image limits as a call's would be; a text model refuses by name."""
        self._check_open()
        images = self.engine.images
        if images is None:
            raise InputError(f"image_tokens: model {self.model_name!r} reads no images (it is not a vision-language "
                             f"model: Qwen2-VL, Qwen2.5-VL or Qwen3-VL)")
        return images.tokens_of(image)

    def get_info(self) -> ModelInfo:
        info = self.engine.info
        return ModelInfo(
            model_name=info.model_name,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            tokenizer_dir=info.tokenizer_dir,
            is_lora=self.lora is not None,
            lora_rank=self.lora.rank if self.lora is not None else None,
            role=self.role,
            engine=self.engine_name,
            sampler=self.sampler_name,
            num_parameters=info.num_parameters,
            num_trainable_parameters=info.num_trainable_parameters,
            prefix_sharing=self.engine.prefix_sharing,
        )
