"""The base models this server serves: which names resolve to them, how long a sequence each
accepts, and how a Backend for one is built.

LoRA training clients of a served model (local engine) are adapters on one
:class:`~skyrl_sdk.SharedBase` per model: the base weights exist once, however many clients
train on them. Full fine-tuning clients (and samplers of exported weights) get a Backend of
their own, counted against ``--max-memory``."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InputError, quoted
from ...types import LoraConfig
from ..config import ServerConfig
from .memory import TRAINING_COPIES, MemoryBudget, weight_bytes

if TYPE_CHECKING:
    from ...backend import Backend
    from ...shared_base import SharedBase

logger = logging.getLogger(__name__)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: torch's default RNG is process-wide: model initialisation (``tiny``, LoRA adapters) and
#: sampling seed and draw from it, so those run one at a time across all workers (or two
#: models created at once would get interleaved draws). Training draws no random numbers
#: and runs concurrently.
RNG_LOCK = threading.RLock()

#: micro-batch budget of the served models when ``--engine-config`` sets none: a long request
#: gives way to other clients' small ones between its micro-batches (docs/server.md, Fairness),
#: so the budget bounds how long a small call waits; 2048 tokens instead of the library's 8192
#: shorten that wait about 4x (docs/performance.md, section 16)
SERVER_MICRO_BATCH_TOKENS = 2048


def _canonical(name: str) -> str:
    if name == "tiny":
        return name
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name.rstrip("/")


def position_limit(model: str) -> int | None:
    """The model's ``max_position_embeddings`` (or equivalent) from its config.json, if any."""
    from ...models.loading import TINY_DIR, max_positions

    directory = TINY_DIR if model == "tiny" else Path(model).expanduser()
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return max_positions(config) if isinstance(config, dict) else None


class ServedModels:
    """``--model`` entries, each with its sequence-length limit (``--max-seq-len`` caps all)."""

    def __init__(self, config: ServerConfig, offload_root: Path | None = None) -> None:
        self.config = config
        #: what every Backend and shared base of this server is built with
        self.engine_config = {"micro_batch_tokens": SERVER_MICRO_BATCH_TOKENS, **config.engine_config}
        self._by_canonical = {_canonical(m): m for m in config.models}
        if "tiny" in config.models:  # the directory client_name gives for it names it too
            self._by_canonical[_canonical(self.client_name("tiny"))] = "tiny"
        self._limits: dict[str, int | None] = {}
        for m in config.models:
            limits = [v for v in (position_limit(m), config.max_seq_len) if v is not None]
            self._limits[m] = min(limits) if limits else None
        self.budget = MemoryBudget(config.max_memory)
        self._pools: dict[str, Any] = {}  # served model -> SharedBase
        self._pools_lock = threading.Lock()
        self._offload_root = offload_root
        if offload_root is not None:  # adapters offloaded by an earlier process are of no use now
            shutil.rmtree(offload_root, ignore_errors=True)

    def resolve(self, name: Any) -> str:
        """The ``--model`` entry a client's ``base_model`` names."""
        if not isinstance(name, str) or not name:
            raise InputError(f"base_model: expected a model name, got {quoted(name)}")
        found = self._by_canonical.get(_canonical(name))
        if found is None:
            raise InputError(f"base model {quoted(name)} is not served here; this server serves "
                             f"{list(self.config.models)}")
        return found

    @staticmethod
    def client_name(base_model: str) -> str:
        """The name of ``base_model`` a tinker client can load the tokenizer of offline (it calls
        ``AutoTokenizer.from_pretrained(name)`` on a sampler's base model): a served directory as
        it is; ``tiny`` as the directory of its tokenizer files (which names it here too)."""
        from ...models.loading import TINY_DIR, TINY_NAME

        return str(TINY_DIR.resolve()) if base_model == TINY_NAME else base_model

    def max_seq_len(self, base_model: str | None) -> int | None:
        """Longest sequence (prompt + completion, or one datum) accepted for ``base_model``."""
        if base_model is None:
            return self.config.max_seq_len
        return self._limits.get(base_model, self.config.max_seq_len)

    # ---- building Backends ------------------------------------------------------------------------
    def sampler_options(self) -> dict[str, Any]:
        """The sampler every Backend of this server samples with (``--sampler``): a plugin sampler
        holding its own copy of the weights serves a shared base's clients from one copy."""
        return {"sampler": self.config.sampler, "sampler_config": dict(self.config.sampler_config)}

    def shares(self, base_model: str) -> bool:
        """Whether LoRA clients of ``base_model`` share one base (local engine, a served model)."""
        return self.config.share_base and self.config.engine == "local" and base_model in self._limits

    def _dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(str(self.config.engine_config.get("dtype", "float32")), 4)

    def shared_bytes(self) -> int:
        """Bytes held by shared bases and their in-memory adapters."""
        with self._pools_lock:
            pools = list(self._pools.values())
        return sum(s["base_bytes"] + s["adapter_bytes"] for s in (p.stats() for p in pools))

    def _pool(self, base_model: str) -> SharedBase:
        from ...shared_base import SharedBase

        with self._pools_lock:
            pool = self._pools.get(base_model)
        if pool is not None:
            return pool
        self.budget.check(f"loading the shared base {base_model}", weight_bytes(base_model, self._dtype_bytes()),
                          self.shared_bytes())
        offload = self._offload_root / f"base-{len(self._pools)}" if self._offload_root is not None else None
        pool = SharedBase(base_model, self.engine_config, seed=self.config.seed,
                          max_lora_adapters=self.config.max_lora_adapters, offload_dir=offload)
        with self._pools_lock:
            self._pools[base_model] = pool
        logger.info("shared base %s loaded: %.1f MiB of weights, shared by its LoRA clients", base_model,
                    pool.stats()["base_bytes"] / 2**20)
        return pool

    def _own_copy(self, model: str, lora: LoraConfig | None, what: str, training: bool) -> Backend:
        from ...backend import Backend

        need = weight_bytes(model, self._dtype_bytes()) * (TRAINING_COPIES if training and lora is None else 1)
        self.budget.check(what, need, self.shared_bytes())
        backend = Backend(model=model, engine=self.config.engine, engine_config=self.engine_config,
                          lora=lora, seed=self.config.seed, **self.sampler_options())
        self.budget.add(backend, need)
        return backend

    def open_backend(self, base_model: str, lora: LoraConfig | None, label: str = "") -> Backend:
        """A training client's Backend (holding the RNG lock while it initialises): an adapter on
        the shared base for LoRA, else a copy of its own."""
        with RNG_LOCK:
            if lora is not None and self.shares(base_model):
                backend = self._pool(base_model).backend(lora, seed=self.config.seed, label=label,
                                                         **self.sampler_options())
            else:
                kind = "a full fine-tuning copy" if lora is None else "a LoRA model (own copy)"
                backend = self._own_copy(base_model, lora, f"{kind} of {base_model}", training=True)
        self.log_loaded()
        return backend

    def sampler_backend(self, model: str, lora: LoraConfig | None = None, own_copy: bool = False) -> Backend:
        """A Backend to sample from: the shared base itself (read-only) for a served model, an
        adapter on it for a LoRA training state, else (exported weights, a full fine-tuning
        state: ``own_copy``) a copy of its own."""
        with RNG_LOCK:
            if self.shares(model) and not own_copy:
                pool = self._pool(model)
                backend = pool.backend(lora, seed=self.config.seed, label="sampler", **self.sampler_options()) \
                    if lora is not None else pool.base_backend(**self.sampler_options())
            else:
                backend = self._own_copy(model, lora, f"a sampler copy of {model}", training=False)
        self.log_loaded()
        return backend

    # ---- visibility -------------------------------------------------------------------------------
    def loaded(self, with_backends: bool = False) -> dict[str, Any]:
        """Shared bases (with their adapters), own copies (with their Backend objects under
        ``backend`` when asked: :mod:`.visibility` finds their owners), and the memory budget."""
        with self._pools_lock:
            pools = list(self._pools.values())
        bases = [p.stats() for p in pools]
        copies = self.budget.copies(with_backends)
        used = sum(b["base_bytes"] + b["adapter_bytes"] for b in bases) + sum(c["bytes"] for c in copies)
        return {"bases": bases, "own_copies": copies,
                "memory": {"used_bytes": used, "max_memory_bytes": self.config.max_memory}}

    def log_loaded(self) -> None:
        doc = self.loaded()
        for b in doc["bases"]:
            offloaded = sum(a["offloaded"] for a in b["adapters"])
            logger.info("loaded: base %s %.1f MiB, %d LoRA adapters (%d in memory, %.2f MiB; %d offloaded)",
                        b["model"], b["base_bytes"] / 2**20, len(b["adapters"]), b["adapters_in_memory"],
                        b["adapter_bytes"] / 2**20, offloaded)
        if doc["own_copies"]:
            logger.info("loaded: %d own copies, %.1f MiB", len(doc["own_copies"]),
                        sum(c["bytes"] for c in doc["own_copies"]) / 2**20)

    def close(self) -> None:
        with self._pools_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
