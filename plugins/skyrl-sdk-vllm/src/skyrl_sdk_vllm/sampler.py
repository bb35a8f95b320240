"""The ``vllm`` sampler: ``Backend.sample`` served by a vLLM engine in this process.

Weights stay in sync with no user action: each call compares the source's ``version`` with
the one the engine holds. Full fine-tuning: the changed weights (all of them: an AdamW step
moves every trained tensor) are copied into the running engine in place (``engines``). LoRA:
only the adapter is pushed, from memory, as a new vLLM adapter id (its prefix-cache entries
are its own), and the previous id is dropped; a snapshot sampler of the server
(``save_weights_and_get_sampling_client``) is another adapter id on the same engine, so
versions never copy the base.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np

from skyrl_sdk.errors import InputError
from skyrl_sdk.sampling import AdapterWeights, Sampler, SampleRequest, WeightsSource
from skyrl_sdk.types import ModelInput, SampleOutput

from . import engines, requests
from .config import VllmSamplerConfig, sampler_dtype
from .loading import on_cpu

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
_names = itertools.count(1)


class VllmSampler(Sampler):
    """See the module docstring; options in :class:`~.config.VllmSamplerConfig`."""

    name = "vllm"
    own_weights = True  # vLLM holds its own copy: the trainer's may wait in host memory meanwhile

    def __init__(self, *, source: WeightsSource, config: Mapping[str, Any]) -> None:
        super().__init__(source=source, config=config)
        options = VllmSamplerConfig.from_mapping(config)
        lora = source.lora is not None or source.base_key is not source  # a shared base's engine runs LoRA
        # refused here, before any engine starts or weight is read (bf16 on a GPU by default)
        dtype = sampler_dtype(options.dtype, source.dtype, cuda=not on_cpu(), lora=lora)
        self.options = attrs.evolve(options, dtype=dtype)
        self.engine: engines.VllmEngine | None = engines.acquire(source, self.options)  # None once closed
        self._label = f"skyrl{next(_names)}"
        self._synced = source.version  # the weights the engine holds (full fine-tuning)
        self._adapter: tuple[int, int] | None = None  # (version, vLLM adapter id) of a LoRA model
        #: the last weight sync: {"kind": "full" or "lora", "seconds": the whole time the sample waited
        #: for it (reading the trainer's weights, the engine's lock, waking vLLM, loading), and its parts
        #: "fetch_seconds", "wake_seconds", "load_seconds"; "bytes", "version"}
        self.last_sync: dict[str, Any] | None = None

    def open_engine(self) -> engines.VllmEngine:
        """:attr:`engine`, refused once this sampler is closed."""
        if self.engine is None:
            raise RuntimeError("this vllm sampler is closed: its engine was released")
        return self.engine

    def describe(self) -> str:
        e = self.open_engine()
        return (f"vllm {e.version} ({'CPU' if e.cpu else 'GPU'}, in process, {e.dtype}, prefix caching "
                f"{'on' if self.options.enable_prefix_caching else 'off'})")

    # ---- sampling ---------------------------------------------------------------------------------
    def before_training(self) -> None:
        """The trainer computes next: vLLM sleeps (``sleep_level``), once per turn (``sleep.py``)."""
        if self.engine is not None:
            self.engine.sleep()

    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        self.refuse(request, requests.SERVED)
        self._check_fits(request)
        t0 = time.perf_counter()
        full = self._full_weights_if_changed()  # read outside the engine's lock (the source's turn)
        adapter = self._adapter_if_changed()
        fetch = time.perf_counter() - t0
        distinct, source_of, counts = _distinct(request.prompts)
        n = [c * request.num_samples for c in counts]
        with self.open_engine().lock, self.open_engine().rng.vllm():
            t1 = time.perf_counter()
            dropped = self.open_engine().wake()  # once per RL step: it slept when the trainer computed
            wake = time.perf_counter() - t1
            if dropped and full is None:  # vLLM dropped its weights while asleep (level 2)
                t2 = time.perf_counter()
                full = (self.source.version, list(self.source.base_weights()))
                fetch += time.perf_counter() - t2
            load, nbytes, kind = 0.0, 0, None
            if full is not None:
                load, nbytes = self.open_engine().load_weights(full[1])
                self._synced, kind = full[0], "full"
            lora, added = self._lora_request(adapter)
            if added is not None:
                load, nbytes, kind = load + added[0], nbytes + added[1], "lora"
            if kind is not None:
                self._record(kind, time.perf_counter() - t0, fetch, wake, load, nbytes)
            outs = self._generate(request, distinct, n, lora)
        return self._outputs(request, distinct, source_of, outs)

    def _check_fits(self, request: SampleRequest) -> None:
        for i, prompt in enumerate(request.prompts):
            if isinstance(prompt, ModelInput):
                raise InputError(f"prompt {i} holds images: the 'vllm' sampler serves token prompts only; "
                                 f"sample a vision-language model with Backend(sampler='transformers')")
        limit = self.open_engine().max_model_len
        # token prompts only (checked above)
        longest = max(len(cast(np.ndarray, p)) for p in request.prompts) + request.sampling_params.max_tokens
        if longest > limit:
            raise InputError(f"prompt + max_tokens = {longest} tokens is more than this vLLM engine's max_model_len "
                             f"{limit} (sampler_config['max_model_len'])")
        if request.topk_prompt_logprobs > self.options.max_logprobs:
            raise InputError(f"topk_prompt_logprobs={request.topk_prompt_logprobs} is more than the vllm sampler's "
                             f"max_logprobs {self.options.max_logprobs} (sampler_config['max_logprobs'])")

    def _full_weights_if_changed(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """The current weights when they changed since the engine got them (full fine-tuning), else None."""
        if self.source.lora is not None or self.source.version == self._synced:
            return None
        return self.source.version, list(self.source.base_weights())

    def _adapter_if_changed(self) -> tuple[int, AdapterWeights] | None:
        """The adapter's tensors when it changed since the engine got it (LoRA), else None."""
        if self.source.lora is None or (self._adapter is not None and self._adapter[0] == self.source.version):
            return None
        return self.source.version, self.source.adapter_weights()

    def _lora_request(self, changed: tuple[int, AdapterWeights] | None) -> tuple[Any, tuple[float, int] | None]:
        """(holding the engine lock) The adapter's request, registering a new version first; and
        that registration's (seconds, bytes), None when nothing was registered."""
        if self.source.lora is None:
            return self.open_engine().base_request(), None
        added = None
        if changed is not None:
            version, weights = changed
            lora_id = self.open_engine().new_adapter_id()
            added = self.open_engine().add_adapter(lora_id, f"{self._label}-v{version}", weights)
            if self._adapter is not None:
                self.open_engine().remove_adapter(self._adapter[1])
            self._adapter = (version, lora_id)
        assert self._adapter is not None  # a first call registers (_adapter_if_changed returns the adapter)
        return self.open_engine().lora_request(self._adapter[1]), added

    def _record(self, kind: str, seconds: float, fetch: float, wake: float, load: float, nbytes: int) -> None:
        self.last_sync = {"kind": kind, "seconds": seconds, "fetch_seconds": fetch, "wake_seconds": wake,
                          "load_seconds": load, "bytes": nbytes, "version": self.source.version}
        logger.debug("vllm sampler %s: %s weights synced, %.1f MiB; the sample waited %.3fs (reading %.3fs, waking "
                     "%.3fs, loading %.3fs)", self._label, kind, nbytes / 2**20, seconds, fetch, wake, load)

    def _generate(self, request: SampleRequest, distinct: list[np.ndarray], n: list[int],
                  lora: Any) -> list[tuple[Any, Any]]:
        """vLLM's outputs per distinct prompt: (the samples, the prompt scores)."""
        eos = self.source.eos_token_id
        plp = requests.prompt_logprobs_of(request)
        prompts = [p.tolist() for p in distinct]
        if self._prefill_first(distinct, n, plp):
            # one greedy token per prompt puts the prompts' blocks in the prefix cache: a group's
            # samples then read them instead of each computing the prompt
            self.open_engine().generate(prompts, [requests.prefill_params()] * len(prompts), lora)
        if plp is not None and lora is not None and self.open_engine().cpu and self._adapts_head():
            # vLLM's CPU LoRA kernels apply an output-head adapter to prompt logprobs only when the
            # batch is one request (their row indices are per request): score each prompt alone
            scores = [self.open_engine().generate([p], [requests.sampling_params(request, eos, n=1, max_tokens=1,
                                                                                 prompt_logprobs=plp)], lora)[0]
                      for p in prompts]
            plp = None
        else:
            scores = None
        params = [requests.sampling_params(request, eos, n=k, prompt_logprobs=plp) for k in n]
        outs = self.open_engine().generate(prompts, params, lora)
        return list(zip(outs, scores or outs, strict=True))

    def _adapts_head(self) -> bool:
        version_weights = self.open_engine().adapters.get(self._adapter[1]) if self._adapter else None
        targets = version_weights[1].config.get("target_modules", ()) if version_weights else ()
        return any(t == "lm_head" or t.endswith(".lm_head") for t in targets)

    def _prefill_first(self, distinct: list[np.ndarray], n: list[int], plp: int | None) -> bool:
        return (self.options.prefill_groups_once and self.options.enable_prefix_caching and plp is None
                and any(k > 1 and len(p) >= self.open_engine().block_size for p, k in zip(distinct, n, strict=True)))

    def _outputs(self, request: SampleRequest, distinct: list[np.ndarray], source_of: list[int],
                 outs: list[tuple[Any, Any]]) -> list[SampleOutput]:
        per_prompt = []
        for prompt, (out, scored) in zip(distinct, outs, strict=True):
            per_prompt.append((requests.sequences(out), requests.prompt_scores(scored, prompt, request)))
        taken = [0] * len(distinct)
        results = []
        for d in source_of:
            seqs, scores = per_prompt[d]
            start = taken[d] * request.num_samples
            taken[d] += 1
            results.append(requests.sample_output(seqs[start:start + request.num_samples], scores))
        return results

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        if self._adapter is not None:
            engine.remove_adapter(self._adapter[1])
            self._adapter = None
        engines.release(engine)


def _distinct(prompts: Sequence[np.ndarray | ModelInput]) -> tuple[list[np.ndarray], list[int], list[int]]:
    """The distinct prompts (first-seen order), each prompt's index among them, and their counts."""
    seen: dict[bytes, int] = {}
    distinct: list[np.ndarray] = []
    source_of: list[int] = []
    counts: list[int] = []
    for p in prompts:
        key = np.asarray(p, dtype=np.int64).tobytes()
        if key not in seen:
            seen[key] = len(distinct)
            distinct.append(np.asarray(p, dtype=np.int64))
            counts.append(0)
        counts[seen[key]] += 1
        source_of.append(seen[key])
    return distinct, source_of, counts

