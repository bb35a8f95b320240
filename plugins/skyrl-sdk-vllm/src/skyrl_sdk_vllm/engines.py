"""vLLM engines, one per base: started once, shared by the samplers of that base.

An engine starts from the model's config and tokenizer alone (``load_format="dummy"``) and
gets its weights from memory (``worker.load_weights``): no weight file is written, at the
start or after a step. Samplers whose sources share a ``base_key`` (the LoRA clients of one
shared base, and that base read as it is) share one engine, each with its own adapters;
any other sampler (full fine-tuning, a solo LoRA model) has an engine of its own.

Every use of an engine holds its lock: vLLM's ``LLM`` serves one caller at a time, and an
adapter must still be loaded when the request that names it runs. vLLM's adapter cache is an
LRU (``max_cpu_loras``); an adapter it dropped is added again from the copy kept here.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import torch

from skyrl_sdk.errors import InputError
from skyrl_sdk.sampling import AdapterWeights, WeightsSource

from . import worker
from .config import LORA_RANKS, VllmSamplerConfig
from .loading import on_cpu, refuse_unservable, start_engine
from .rng import RngStreams
from .sleep import SleepMode

logger = logging.getLogger(__name__)

#: the KV cache on CPU when sampler_config gives no kv_cache_gib
CPU_KV_CACHE_GIB = 1.0
#: the default largest LoRA rank of an engine (a larger first model raises it)
DEFAULT_MAX_LORA_RANK = 64
#: the id of the empty adapter that stands for the bare base on CPU (``VllmEngine.base_request``)
NULL_ADAPTER = 1


class VllmEngine:
    """One ``vllm.LLM`` in this process (see the module docstring)."""

    #: its entry in the shared registry (set by :func:`acquire`, read by :func:`release`)
    key: tuple[Hashable, str]

    def __init__(self, source: WeightsSource, options: VllmSamplerConfig, shared: bool,
                 base_weights: list[tuple[str, torch.Tensor]]) -> None:
        self.options = options
        self.lock = threading.RLock()
        self.users = 0
        self.shared = shared
        self.lora = shared or source.lora is not None
        self.adapters: dict[int, tuple[str, AdapterWeights]] = {}  # what this engine's samplers registered
        self._ids = iter(range(NULL_ADAPTER + 1, 2**31))
        refuse_unservable(source.hf_config, source.model_name)
        self.sleep_mode = SleepMode(options.sleep_level)  # when it sleeps and wakes (sleep.py)
        self.rng = RngStreams()  # vLLM's draws apart from the trainer's (rng.py)
        self.cpu = on_cpu()
        self.hf_config = source.hf_config
        if options.sleep_level and self.cpu:
            raise InputError("sampler_config['sleep_level']: vLLM's CPU backend has no sleep mode; it frees GPU memory")
        if options.sleep_level == 2 and self.lora:
            raise InputError("sampler_config['sleep_level']=2 drops the base weights, which a LoRA model's sampler "
                             "would then reload from the trainer at every call; use 1")
        self._dir = Path(tempfile.mkdtemp(prefix="skyrl-vllm-"))
        t0 = time.perf_counter()
        try:
            source.hf_config.save_pretrained(self._dir)
            if source.tokenizer is not None:
                source.tokenizer.save_pretrained(str(self._dir))
            with self.rng.vllm():
                self.llm = start_engine(**self._engine_args(source))
                self.load_weights(base_weights)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.block_size = int(self.llm.llm_engine.vllm_config.cache_config.block_size)
        import vllm

        self.version = vllm.__version__
        logger.info("vLLM %s engine for %s started in %.1fs (%s, %s, max_model_len %d%s)", self.version,
                    source.model_name, time.perf_counter() - t0, "CPU" if self.cpu else "GPU", self.dtype,
                    self.max_model_len, ", LoRA" if self.lora else "")

    def _engine_args(self, source: WeightsSource) -> dict[str, Any]:
        o = self.options
        self.dtype = o.dtype or source.dtype  # VllmSampler resolved it (config.sampler_dtype)
        args: dict[str, Any] = dict(
            model=str(self._dir), tokenizer=str(self._dir), load_format="dummy", dtype=self.dtype, seed=o.seed,
            enforce_eager=self.cpu if o.enforce_eager is None else o.enforce_eager,
            enable_prefix_caching=o.enable_prefix_caching, max_logprobs=o.max_logprobs,
            logprobs_mode="raw_logprobs", generation_config="vllm", enable_sleep_mode=o.sleep_level > 0,
        )
        if self.cpu:
            args["kv_cache_memory_bytes"] = int((o.kv_cache_gib or CPU_KV_CACHE_GIB) * 2**30)
        else:
            args["gpu_memory_utilization"] = o.gpu_memory_utilization
            if o.kv_cache_gib is not None:
                args["kv_cache_memory_bytes"] = int(o.kv_cache_gib * 2**30)
        if o.max_model_len is not None:
            args["max_model_len"] = o.max_model_len
        if o.max_num_seqs is not None:
            args["max_num_seqs"] = o.max_num_seqs
        if self.lora:
            rank = source.lora.rank if source.lora is not None else 1
            self.max_lora_rank = o.max_lora_rank or next(r for r in LORA_RANKS if r >= max(rank, DEFAULT_MAX_LORA_RANK))
            args.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=o.max_loras,
                        max_cpu_loras=o.max_cpu_loras)
        return {**args, **o.engine_args}

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[float, int]:
        """Copy ``weights`` into the running model in place and forget the prefix cache (its
        keys and values were computed with the old weights). Returns (seconds, bytes)."""
        t0 = time.perf_counter()
        pairs = list(weights)
        with self.lock, self.rng.vllm():
            self.llm.collective_rpc(worker.load_weights, args=(pairs,))
            self.llm.reset_prefix_cache()
        return time.perf_counter() - t0, sum(t.numel() * t.element_size() for _, t in pairs)

    def new_adapter_id(self) -> int:
        with self.lock:
            return next(self._ids)

    def add_adapter(self, lora_id: int, name: str, adapter: AdapterWeights) -> tuple[float, int]:
        """Register an adapter from memory (and keep the copy, to add it again if vLLM drops it)."""
        rank = int(adapter.config.get("r", 0))
        if rank > self.max_lora_rank:
            raise InputError(f"LoRA rank {rank} is above this vLLM engine's max_lora_rank {self.max_lora_rank} "
                             f"(set sampler_config['max_lora_rank'] to one of {LORA_RANKS} at least {rank})")
        t0 = time.perf_counter()
        with self.lock, self.rng.vllm():
            self.llm.collective_rpc(worker.add_adapter, args=(lora_id, adapter.tensors, adapter.config))
            self.adapters[lora_id] = (name, adapter)
        return time.perf_counter() - t0, sum(t.numel() * t.element_size() for t in adapter.tensors.values())

    def remove_adapter(self, lora_id: int) -> None:
        with self.lock, self.rng.vllm():
            if self.adapters.pop(lora_id, None) is not None and self.sleep_mode.asleep == 0:
                self.llm.collective_rpc(worker.remove_adapter, args=(lora_id,))

    def base_request(self) -> Any:
        """(holding the lock) What a request of the bare base names: nothing, except on CPU with LoRA
        on, where vLLM's CPU LoRA kernels index "no adapter" (-1) as the last adapter slot and apply
        that adapter; there a zero adapter (rank 1 on the output head, all zeros: a delta of 0 on
        every layer) stands for the base."""
        if not (self.cpu and self.lora):
            return None
        if NULL_ADAPTER not in self.adapters:
            hidden, vocab = int(self.hf_config.hidden_size), int(self.hf_config.vocab_size)
            zero = AdapterWeights(config={"r": 1, "lora_alpha": 1, "target_modules": ["lm_head"]}, tensors={
                "base_model.model.lm_head.lora_A.weight": torch.zeros(1, hidden),
                "base_model.model.lm_head.lora_B.weight": torch.zeros(vocab, 1)})
            self.adapters[NULL_ADAPTER] = ("skyrl-base", zero)
        return self.lora_request(NULL_ADAPTER)

    def lora_request(self, lora_id: int) -> Any:
        """(holding the lock) The request naming adapter ``lora_id``, which is loaded now."""
        from vllm.lora.request import LoRARequest

        name, adapter = self.adapters[lora_id]
        with self.rng.vllm():
            if lora_id not in self.llm.collective_rpc(worker.loaded_adapters)[0]:  # vLLM's LRU dropped it
                self.llm.collective_rpc(worker.add_adapter, args=(lora_id, adapter.tensors, adapter.config))
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=f"skyrl-sdk-vllm/memory/{lora_id}")

    # ---- serving ----------------------------------------------------------------------------------
    def wake(self) -> bool:
        """(holding the lock) Before sampling: wake vLLM if it sleeps; True when its weights were
        dropped (level 2). Once per RL step, not per sample call (``sleep.py``)."""
        with self.rng.vllm():
            return self.sleep_mode.wake(self.llm)

    def sleep(self) -> bool:
        """Before the trainer computes: sleep at ``sleep_level`` (the trainer gets the memory)."""
        with self.lock, self.rng.vllm():
            return self.sleep_mode.sleep(self.llm)

    def generate(self, prompts: list[list[int]], params: list[Any], lora_request: Any = None) -> list[Any]:
        with self.rng.vllm():
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                     lora_request=lora_request)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:  # vLLM 0.32's LLM has no shutdown of its own; its engine core client's is the public one
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # shutting down must not hide the caller's own error
                logger.warning("vLLM engine shutdown: %r", exc)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        shutil.rmtree(self._dir, ignore_errors=True)


_registry: dict[tuple[Hashable, str], VllmEngine] = {}
_registry_lock = threading.Lock()


def acquire(source: WeightsSource, options: VllmSamplerConfig) -> VllmEngine:
    """The engine of ``source``'s base with these options: shared when the base is shared, else new."""
    shared = source.base_key is not source
    key = (source.base_key, options.key())
    weights = list(source.base_weights())  # read outside the lock: it takes the source's turn on a shared base
    with _registry_lock:
        engine = _registry.get(key) if shared else None
        if engine is None:
            engine = VllmEngine(source, options, shared, weights)
            if shared:
                _registry[key] = engine
        engine.users += 1
        engine.key = key
        return engine


def release(engine: VllmEngine) -> None:
    """One user fewer; the last one closes the engine."""
    with _registry_lock:
        engine.users -= 1
        if engine.users > 0:
            return
        _registry.pop(engine.key, None)
    engine.close()


def engines_running() -> int:
    """How many shared engines are up (tests, the server's view)."""
    with _registry_lock:
        return len(_registry)
