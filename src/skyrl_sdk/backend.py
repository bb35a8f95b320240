"""The Backend facade: validate -> convert -> engine -> typed outputs.

Tinker semantics: losses SUM over tokens, gradients of successive ``forward_backward``
calls add up until ``optim_step``, ``target_tokens`` are scored exactly as sent, every
``AdamParams`` field is honoured. Bad input raises a ``ValueError`` subclass before any
compute and leaves no trace.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .builtin_plugins import get_registry
from .engines import call_grads
from .errors import CheckpointError, CriticExportWarning, DatumError, InputError
from .inputs.coerce import adam_params_from_any, data_from_any, lora_config_from_any
from .inputs.sample import sample_call
from .losses.metrics import MetricAccumulator
from .losses.resolve import ResolvedLoss, reading_values
from .losses.run import add_prepared_inputs
from .losses.stability import SequenceRecords, resolve_provenance
from .losses.validation import check_call, check_prompts, check_target_ids, inputs_for_forward
from .models.checkpoint import atomic_directory, read_json, reject_symlinks, write_json
from .models.value_head import critic_export_note, write_critic_card
from .plugins.samplers import Sampler, SampleRequest, check_sampler
from .types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadStateOutput,
    ModelInfo,
    ModelInput,
    OptimStepOutput,
    SampleOutput,
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
        engine: str = "local",
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
        factory = None if isinstance(engine, str) else engine
        if factory is not None and not callable(factory):
            raise InputError(f"engine: expected an engine name, got {type(engine).__name__}")
        if factory is None:
            registry.engine_spec(engine)
        registry.sampler_spec(sampler)
        if sampler_config is not None and not isinstance(sampler_config, Mapping):
            raise InputError(f"sampler_config: expected a mapping, got {type(sampler_config).__name__}")
        self.sampler_name = sampler
        self._sampler_config = dict(sampler_config or {})
        self._sampler = None  # built on the first sample(): a sampler may hold a second model
        self._source = None  # what the sampler reads: the engine's weights_source(), built with it
        self.model_name = str(model)
        self.role = role
        self.dialect = dialect
        self.seed = seed
        self.lora = lora_config_from_any(lora)
        self.grad_accumulation = grad_accumulation
        self.engine_name = engine if factory is None else str(getattr(factory, "engine_name", "custom"))
        self._lock = threading.RLock()
        #: sequences sampled with ``record_stability_info=True``, which provenance names
        #: (``stable_reinforce``); replaceable by a store shared with other samplers (the server's session)
        self.sequences = SequenceRecords()
        self._calls_since_step = 0
        self._closed = False
        t0 = time.perf_counter()
        self.engine = (factory or registry.engines[engine].factory)(
            model=self.model_name, role=role, lora=self.lora, seed=seed, engine_config=dict(engine_config or {})
        )
        logger.info("Backend ready: model=%s engine=%s role=%s lora=%s (%.1fs)",
                    self.model_name, self.engine_name, role, self.lora, time.perf_counter() - t0)

    # ---- context manager --------------------------------------------------------------
    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
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
    def tokenizer(self):
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

    def _prepare(self, data: Sequence[Any], loss_fn: str, loss_fn_config,
                 backward: bool = True) -> tuple[list[Datum], ResolvedLoss]:
        resolved = self.resolve(loss_fn, loss_fn_config)
        datums = data_from_any(data)
        inputs = self._read_images([d.model_input for d in datums], lambda i, msg: DatumError(msg, index=i))
        datums = [d if mi is d.model_input else attrs.evolve(d, model_input=mi)
                  for d, mi in zip(datums, inputs, strict=True)]
        if resolved.spec.needs_provenance:  # the recorded sampler logprobs, named by each datum's provenance
            datums = resolve_provenance(datums, self.sequences)
        if not backward:  # no gradient: take the inputs this loss reads, leave the other losses' alone
            known = {k for spec in get_registry().losses.values() for k in spec.required_inputs + spec.optional_inputs}
            datums = inputs_for_forward(datums, resolved.spec, known)
            if datums:  # a critic's datums without values/returns: read the values
                resolved = reading_values(resolved, set(datums[0].loss_fn_inputs))
        resolved = check_call(datums, resolved, self.vocab_size, self.engine.info.max_positions)  # before compute
        if resolved.spec.prepare is not None and not resolved.scores_only:
            datums = add_prepared_inputs(datums, resolved, self.engine.run(datums, resolved, backward=False).outputs)
        return datums, resolved

    def _read_images(self, inputs: list[ModelInput], error) -> list[ModelInput]:
        """``inputs`` with their images read by the model's image processor (checked against the
        image limits first, then decoded), or refused by name when the model reads no images."""
        if not any(mi.has_images for mi in inputs):
            return inputs
        images = getattr(self.engine, "images", None)
        if images is None:
            i = next(i for i, mi in enumerate(inputs) if mi.has_images)
            raise error(i, f"model_input holds an image, but model {self.model_name!r} reads no images (it is not "
                           f"a vision-language model: Qwen2-VL, Qwen2.5-VL or Qwen3-VL)")
        return images.prepare(inputs, error)

    @staticmethod
    def _outputs(result) -> ForwardBackwardOutput:
        outputs = [{k: TensorData(np.ascontiguousarray(v)) for k, v in o.items()} for o in result.outputs]
        acc = MetricAccumulator()
        acc.merge([result.metric_state])
        return ForwardBackwardOutput(
            loss_fn_output_type=LOSS_FN_OUTPUT_TYPE, loss_fn_outputs=outputs, metrics=acc.result()
        )

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardOutput:
        """Score ``data`` with ``loss_fn`` and add the gradient of the summed loss."""
        with self._lock:
            self._check_open()
            datums, resolved = self._prepare(data, loss_fn, loss_fn_config)
            t0 = time.perf_counter()
            try:
                result = self.engine.run(datums, resolved, backward=True)
            except BaseException as exc:
                self._after_failed_call(exc)
                raise
            self._calls_since_step += 1
            logger.info("forward_backward(%s): %d datums, %.3fs", resolved.name, len(datums), time.perf_counter() - t0)
            return self._outputs(result)

    def _after_failed_call(self, exc: BaseException) -> None:
        """Keep the count of calls since the last step right after a failed forward_backward, and
        say in the error what became of the pending gradients (the engine records it)."""
        kept = call_grads.outcome(exc)
        if kept is None:
            return
        earlier = self._calls_since_step
        what = f"the pending gradients of the {earlier} earlier forward_backward call(s) since the last step"
        if kept == call_grads.DROPPED:
            self._calls_since_step = 0
            note = f"{what} were dropped too (engine_config keep_grads_on_error=False)"
        else:
            note = f"{what} were kept as they were" if earlier else "no gradients were pending"
        notes = getattr(exc, "__notes__", None)
        exc.__notes__ = [*(notes if isinstance(notes, list) else []),
                         f"forward_backward failed mid-call: this call's partial gradients were dropped; {note}"]

    def forward(
        self, data: Sequence[Any], loss_fn: str | None = None, loss_fn_config: Mapping[str, Any] | None = None
    ) -> ForwardBackwardOutput:
        """Like :meth:`forward_backward` but computes no gradient and changes no state.

        The datums may carry inputs of other losses (a policy's ``logprobs``, ``advantages``,
        ``ref_logprobs``): a reference model's ``forward(data, "cross_entropy")`` scores the
        policy's datums as they are. Keys no loss uses are refused as in ``forward_backward``."""
        with self._lock:
            self._check_open()
            datums, resolved = self._prepare(data, loss_fn, loss_fn_config, backward=False)
            return self._outputs(self.engine.run(datums, resolved, backward=False))

    def optim_step(self, adam_params: Any = None) -> OptimStepOutput:
        """Apply AdamW with exactly ``adam_params`` to the accumulated gradients, then clear them."""
        params = AdamParams() if adam_params is None else adam_params_from_any(adam_params)
        with self._lock:
            self._check_open()
            scale = 1.0
            if self.grad_accumulation == "mean" and self._calls_since_step > 1:
                scale = 1.0 / self._calls_since_step
            metrics = self.engine.optim_step(params, scale)
            self.weights_changed()
            metrics["num_forward_backward_calls"] = float(self._calls_since_step)
            self._calls_since_step = 0
            return OptimStepOutput(metrics=metrics)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last optim_step."""
        with self._lock:
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

        ``topk_prompt_logprobs=k`` also returns, per prompt position, the k most likely tokens
        and their logprobs (Tinker's field). ``record_stability_info=True`` records every
        sampled sequence in :attr:`sequences` and gives it a ``sequence_id`` that a datum's
        provenance names (``stable_reinforce``). Tinker's other scores, from the same pass:
        ``topk_sample_logprobs=k`` (per sampled position, the k most likely tokens: each
        sequence's ``topk_logprobs``), ``target_prompt_logprobs`` (per prompt, an int64
        ``[len(prompt) - 1, K]`` array of token ids to score at positions 1.., -1 for none, or
        None: the output's ``target_prompt_logprobs``) and ``prompt_alt_tokens_k=k`` (k draws
        at every prompt position after the first, at the request's temperature: the output's
        ``prompt_alt_tokens``). Served by this Backend's sampler (``sampler=``); a score the
        sampler does not serve is refused by name. The sampler is built on the first call
        with the engine's weights (``Engine.weights_source()``).
        """
        call = sample_call(prompts, sampling_params, num_samples, prompt_logprobs, topk_prompt_logprobs,
                           record_stability_info, topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k)
        params = call.sampling_params
        prompts = list(call.prompts)
        where = [i for i, p in enumerate(prompts) if isinstance(p, ModelInput)]
        if where:  # decoded here, in the caller's thread (the server's compute thread)
            read = self._read_images([prompts[i] for i in where],
                                     lambda k, msg: InputError(f"prompt {where[k]}: {msg}"))
            for i, model_input in zip(where, read, strict=True):
                prompts[i] = model_input
        check_prompts([p.to_numpy() if isinstance(p, ModelInput) else p for p in prompts], self.vocab_size,
                      self.engine.info.max_positions, params.max_tokens)
        check_target_ids(call.target_prompt_logprobs, self.vocab_size)
        request = SampleRequest(prompts, params, call.num_samples, call.prompt_logprobs, call.topk_prompt_logprobs,
                                call.topk_sample_logprobs, call.target_prompt_logprobs, call.prompt_alt_tokens_k)
        outs = self._sample(request)
        if not call.record_stability_info:
            return outs
        return [self._recorded(p, out) for p, out in zip(call.prompts, outs, strict=True)]

    def _sample(self, request: SampleRequest) -> list[SampleOutput]:
        """A sampler that runs apart from the trainer samples outside the lock (a training call
        does not delay it), its weights synced under the lock first when they moved."""
        sampler = self._sampler
        if sampler is None or not sampler.runs_apart:
            with self._lock:
                self._check_open()
                sampler = self._built_sampler()
                if not sampler.runs_apart:
                    return sampler.sample(request)
        self._check_open()
        if not sampler.weights_current():
            with self._lock:
                self._check_open()
                sampler.sync_weights()
        return sampler.sample(request)

    def _recorded(self, prompt: np.ndarray, out: SampleOutput) -> SampleOutput:
        """Record the samples of ``prompt`` in :attr:`sequences`; they carry their ``sequence_id``."""
        ids = self.sequences.new_ids(len(out.sequences))
        self.sequences.record(prompt, out.sequences, ids)
        return attrs.evolve(out, sequences=[attrs.evolve(s, sequence_id=i)
                                            for s, i in zip(out.sequences, ids, strict=True)])

    @property
    def sampler(self) -> Sampler | None:
        """The sampler serving :meth:`sample` once the first call built it (None before): its
        ``describe()`` says what it is."""
        return self._sampler

    def _built_sampler(self) -> Sampler:
        """(holding the lock) The sampler, built on first use with the engine's weights source."""
        if self._sampler is None:
            factory = get_registry().sampler_spec(self.sampler_name).factory
            source = self.engine.weights_source()
            sampler = check_sampler(factory(source=source, config=dict(self._sampler_config)), self.sampler_name)
            self._source, self._sampler = source, sampler
            logger.info("sampler of %s: %s", self.model_name, sampler.describe())
        return self._sampler

    def weights_changed(self) -> None:
        """Tell the sampler the engine's weights changed, so it samples the new ones. ``optim_step``
        and ``load_state`` call it; call it after changing the weights any other way."""
        with self._lock:
            if self._source is not None:
                self._source.weights_changed()

    # ---- saving -----------------------------------------------------------------------
    def save_weights_for_sampler(
        self, path: str | Path, *, merge_lora: bool = True, overwrite: bool = False
    ) -> SaveWeightsForSamplerOutput:
        """Write a Hugging Face model directory (LoRA merged unless ``merge_lora=False``).

        A critic has no lm_head, so its export is no model to sample from: it is written
        (backbone and value head, with a README.md saying so) and a warning says how to load it."""
        with self._lock:
            self._check_open()
            with atomic_directory(path, overwrite=overwrite) as tmp:
                self.engine.export_weights(tmp, merge_lora=merge_lora)
                if self.role == "critic":
                    write_critic_card(tmp)
            if self.role == "critic":
                warnings.warn(critic_export_note(path), CriticExportWarning, stacklevel=2)
            return SaveWeightsForSamplerOutput(path=str(Path(path).expanduser().resolve()))

    def _identity(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "architecture": self.engine.info.architecture,
            "vocab_size": self.engine.info.vocab_size,
            "num_parameters": self.engine.info.num_parameters,
            "role": self.role,
            "lora": attrs.asdict(self.lora) if self.lora is not None else None,
        }

    def save_state(self, path: str | Path, *, overwrite: bool = False) -> SaveStateOutput:
        """Weights, optimizer moments and step counts, LoRA config and metadata; atomic, no pickle."""
        with self._lock:
            self._check_open()
            with atomic_directory(path, overwrite=overwrite) as tmp:
                engine_meta = self.engine.save_state(tmp)
                write_json(tmp / METADATA_FILE, {
                    "format": STATE_FORMAT,
                    "sdk_version": __version__,
                    "engine": self.engine_name,
                    "saved_at": time.time(),
                    "identity": self._identity(),
                    "engine_state": engine_meta,
                })
            return SaveStateOutput(path=str(Path(path).expanduser().resolve()))

    def load_state(self, path: str | Path, optimizer: bool = True) -> LoadStateOutput:
        """Load a :meth:`save_state` directory; refuses a state of another model."""
        directory = Path(path).expanduser()
        with self._lock:
            self._check_open()
            if not directory.is_dir():
                raise CheckpointError(f"no checkpoint directory at {directory}")
            reject_symlinks(directory)
            meta = read_json(directory / METADATA_FILE)
            where = str(directory / METADATA_FILE)
            if not isinstance(meta, dict):
                raise CheckpointError(f"{where}: expected a JSON object, got {type(meta).__name__}")
            if meta.get("format") != STATE_FORMAT:
                raise CheckpointError(f"{where}: unsupported state format {meta.get('format')!r}")
            for key in ("identity", "engine_state"):
                if not isinstance(meta.get(key), dict):
                    raise CheckpointError(f"{where}: {key}: expected an object, got {meta.get(key)!r}")
            mine, theirs = self._identity(), meta["identity"]
            for key in ("architecture", "vocab_size", "num_parameters", "role", "lora"):
                if mine.get(key) != theirs.get(key):
                    raise CheckpointError(
                        f"{directory} holds a state of another model: {key} is {theirs.get(key)!r} there, "
                        f"{mine.get(key)!r} here"
                    )
            self.engine.load_state(directory, meta["engine_state"], optimizer)
            self.weights_changed()
            self._calls_since_step = 0
            return LoadStateOutput(path=str(directory.resolve()), optimizer_loaded=optimizer)

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
            # an in-process engine's runner knows it now (its self-test runs at the first call)
            prefix_sharing=getattr(getattr(self.engine, "runner", None), "prefix_status", None)
            or getattr(info, "prefix_sharing", "off"),
        )
