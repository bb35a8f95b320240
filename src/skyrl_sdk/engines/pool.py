"""One copy of a base model shared by many LoRA adapters (the multi-tenant engine's pool).

The base is loaded once and wrapped with peft; every client is one peft adapter of its own
(``add_adapter``), with its own LoRA tensors, :class:`AdapterRunner` (AdamW state, step
count, pending gradients). Compute runs inside :meth:`AdapterPool.using`: a round-robin turn
on the base (:class:`~.turns.FairGate`), the client's adapter made the only active one
(``set_adapter``), then the compute. A forward or backward call takes one turn per
micro-batch (:func:`~.turns.each_step`): between two of them another client's turn may run,
and the next turn makes the call's adapter active again. Only the active adapter takes part in
a forward pass, so another client's pending gradients are never touched.

Why peft's multi-adapter support rather than swapping tensors into one adapter slot: each
adapter keeps its own rank, alpha and target modules (clients may differ), and the forward
pass is peft's own, so the arithmetic is exactly a solo LoRA Backend's. What differs from a
solo model is only the adapter's *name* inside peft; :class:`AdapterRunner` and the engine
translate it to the solo name (``default``) so gradients, optimizer files, checkpoints and
exports have a solo Backend's names.

Capacity: at most ``max_adapters`` adapters keep their tensors in memory; beyond that the
least recently used one is written to ``offload_dir`` (safetensors, :mod:`.offload`) and
read back when its client next calls.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..errors import InputError, ModelLoadError
from ..models.attention import check_available
from ..models.loading import load_model, lora_targets, peft_model, quiet_peft_wrap
from ..models.scoring import ScoringModel, count_parameters
from ..types import LoraConfig
from . import offload
from .base import image_inputs, runner_options, scoring_model
from .config import EngineConfig
from .runner import ModelRunner
from .turns import FairGate

if TYPE_CHECKING:
    import peft
    from peft import PeftMixedModel, PeftModel

logger = logging.getLogger(__name__)

#: The adapter name a solo LoRA Backend's peft model uses (its checkpoints carry it).
SOLO_ADAPTER = "default"


class AdapterRunner(ModelRunner):
    """A :class:`ModelRunner` that sees only one adapter's parameters, under their solo names."""

    def __init__(self, scoring: ScoringModel, params: list[tuple[str, torch.nn.Parameter]], **kwargs: Any) -> None:
        super().__init__(scoring, **kwargs)
        self._params = params

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self._params)


@attrs.define(eq=False)
class Adapter:
    """One client's LoRA adapter on a :class:`AdapterPool`."""

    name: str  #: the peft adapter name (unique in the pool, never reused)
    label: str  #: what the owner calls it (a server model id), for logs and stats
    lora: LoraConfig
    runner: AdapterRunner
    num_parameters: int
    offloaded: Path | None = None
    last_used: int = 0
    closed: bool = False
    #: bytes of its weights, pending gradients and AdamW state, measured at the end of its
    #: last turn: only the turn's holder may read the tensors (a C++ backward on another
    #: thread replaces ``p.grad`` without the GIL; reading it then corrupted the heap)
    resident_bytes: int = 0


def solo_name(key: str, adapter: str) -> str:
    """``key`` with the peft adapter name ``adapter`` replaced by the solo one."""
    return ".".join(SOLO_ADAPTER if part == adapter else part for part in key.split("."))


class AdapterPool:
    """A base model loaded once; LoRA adapters added and removed while it serves."""

    def __init__(
        self, model: str, *, role: str = "policy", seed: int = 0, engine_config: dict | None = None,
        max_adapters: int | None = None, offload_dir: str | Path | None = None,
    ) -> None:
        if max_adapters is not None and (isinstance(max_adapters, bool) or not isinstance(max_adapters, int)
                                         or max_adapters < 1):
            raise InputError(f"max_lora_adapters: expected an integer >= 1, got {max_adapters!r}")
        self.config = EngineConfig.from_mapping(engine_config)
        if self.config.world_size != 1:
            raise InputError("engine_config['world_size']: a shared base runs on one device (world_size 1)")
        if self.config.offload_while_sampling:
            raise InputError("engine_config['offload_while_sampling']: a shared base serves every client's calls; it "
                             "cannot leave the device while one of them samples (use it with a Backend of its own)")
        self.device = self.config.torch_device()
        check_available(self.config.attn_implementation, self.device.type)
        self.model_name, self.role, self.seed = str(model), role, seed
        self.max_adapters = max_adapters
        # fp32 masters under a narrower compute dtype, exactly as the local engine does
        self.loaded = load_model(model, role=role, lora=None, seed=seed, dtype=self.config.master_torch_dtype,
                                 device=self.device, train_vision_tower=self.config.train_vision_tower,
                                 attn_implementation=self.config.attn_implementation)
        self.images = image_inputs(model, self.config)
        self._runner_options = runner_options(self.config, self.loaded, self.device)
        base = self.loaded.module
        #: the transformers model itself: peft injects adapter layers into it in place, and it
        #: stays valid when no adapter is left (the peft wrapper then has no active config)
        self.plain = base
        self._peft: PeftModel | PeftMixedModel | None = None
        self.base_parameters, _ = count_parameters(base)
        self.base_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in base.parameters()}.values())
        # Targets are chosen on the plain model (once wrapped, its Linears are peft layers).
        self._targets = {flags: lora_targets(base, LoraConfig(rank=1, train_attn=flags[0], train_mlp=flags[1],
                                                               train_unembed=flags[2]), self.config.train_vision_tower)
                         for flags in itertools.product((False, True), repeat=3) if any(flags)}
        scoring = scoring_model(base, role, self.config)
        #: ``None`` once the pool is closed (the model freed)
        self.scoring: ScoringModel | None = scoring
        self.gate = FairGate()
        #: the runner of read-only uses of the base (no trainable parameters)
        self.base_runner = AdapterRunner(scoring, [], **self._runner_options)
        self.adapters: dict[str, Adapter] = {}
        self._names = itertools.count(1)
        self._clock = itertools.count(1)
        self._lock = threading.Lock()  # the adapters dict (stats read it from other threads)
        self._offload_root = Path(offload_dir) if offload_dir is not None else None
        self._own_offload_dir = False
        self.offloads = self.reloads = 0
        self.offload_seconds = self.reload_seconds = 0.0
        self.closed = False
        #: the adapter peft has active, as set by ``using`` (None: unknown, set it again);
        #: ``set_adapter`` walks every adapter layer, so a turn of the same adapter skips it
        self._active: str | None = None
        #: whether peft's adapter layers are enabled (a base-only turn disables them)
        self._adapters_enabled: bool | None = True
        #: the adapter of the turn in progress (None: none, or the base alone)
        self._holder: Adapter | None = None
        #: adapters with a call in progress (paused between micro-batches or computing) -> how many
        self._calls: collections.Counter[str] = collections.Counter()

    # ---- the module -------------------------------------------------------------------------------
    @property
    def module(self) -> Any:  # a PeftModel while adapters exist (None before the first one and once closed)
        """The peft wrapper of the shared model (None until the first adapter): its state dict
        and ``save_pretrained`` name things as a solo LoRA model's do."""
        return self._peft

    def _rebuild_scoring(self) -> None:
        """Adapters may wrap the output projection: scoring must call the current one."""
        self._active = None  # an adapter was added or removed: peft may have changed which is active
        self._adapters_enabled = None  # and a new adapter's layers start enabled
        self.scoring = scoring_model(self.plain, self.role, self.config)
        self.base_runner.scoring = self.scoring
        for a in self.adapters.values():
            a.runner.scoring = self.scoring

    def _peft_config(self, lora: LoraConfig) -> peft.LoraConfig:
        import peft

        targets = self._targets[(lora.train_attn, lora.train_mlp, lora.train_unembed)]
        if not targets:
            raise ModelLoadError("LoRA: no Linear modules matched train_attn/train_mlp/train_unembed")
        # the same settings as models.apply_lora (a test compares the two adapters bit for bit)
        # peft annotates lora_alpha int; it divides a float alpha alike
        return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]
                               lora_dropout=0.0, target_modules=targets,
                               bias="none")

    # ---- adapters ---------------------------------------------------------------------------------
    def add_adapter(self, lora: LoraConfig, seed: int, label: str = "") -> Adapter:
        """A new adapter initialised exactly as ``load_model(..., lora=lora, seed=seed)`` would."""
        config = self._peft_config(lora)
        name = f"skyrl{next(self._names)}"
        with self.gate.turn(("add", name)):
            self._check_open()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(lora.seed if lora.seed is not None else seed)
                if self._peft is not None:
                    with quiet_peft_wrap():
                        self._peft.add_adapter(name, config)
                else:
                    self._peft = peft_model(self.plain, config, adapter_name=name)
            self.module.to(self.device)
            self.module.eval()
            params = [(solo_name(n, name), p) for n, p in self.module.named_parameters() if name in n.split(".")]
            if self.scoring is None:
                raise RuntimeError("this engine is closed: its model was released")
            runner = AdapterRunner(self.scoring, params, **self._runner_options)
            adapter = Adapter(name, label or name, lora, runner, sum(p.numel() for _, p in params),
                              last_used=next(self._clock), resident_bytes=offload.adapter_bytes(runner))
            with self._lock:
                self.adapters[name] = adapter
            self._rebuild_scoring()
            self._evict_beyond_capacity(keep=adapter)
        logger.info("shared base %s: adapter %s (%s, rank %d) added; %d adapters", self.model_name, adapter.label,
                    name, lora.rank, len(self.adapters))
        return adapter

    def remove_adapter(self, adapter: Adapter) -> None:
        """Free an adapter (its tensors, optimizer state and any offload file)."""
        with self.gate.turn(adapter.name):
            if adapter.closed:
                return
            adapter.closed = True
            adapter.runner.optimizer.release()
            adapter.runner.zero_grad()
            if adapter.offloaded is not None:
                adapter.offloaded.unlink(missing_ok=True)
                adapter.offloaded = None
            with self._lock:
                self.adapters.pop(adapter.name, None)
            if not self.closed:
                others = [name for name in self.module.peft_config if name != adapter.name]
                if others and adapter.name in self.module.active_adapters:
                    # peft would switch itself, warning once per layer ("was active which is now deleted")
                    self.module.set_adapter(others[0])
                self.module.delete_adapter(adapter.name)
                self._rebuild_scoring()
        logger.info("shared base %s: adapter %s removed; %d adapters", self.model_name, adapter.label,
                    len(self.adapters))

    @contextlib.contextmanager
    def using(self, adapter: Adapter | None) -> Iterator[None]:
        """A turn on the base with exactly ``adapter`` active (None: the base alone). Turns never
        nest (:class:`~.turns.FairGate`): a call paused between micro-batches holds none."""
        with self.gate.turn(adapter.name if adapter is not None else "base"):
            self._check_open()
            if adapter is not None and adapter.closed:
                raise InputError(f"adapter {adapter.label} was removed from its shared base")
            self._holder = adapter
            try:
                self._activate(adapter)
                yield
            finally:
                self._holder = None
                if adapter is not None:
                    adapter.resident_bytes = offload.adapter_bytes(adapter.runner)
                if not self.closed:  # outside turns, adapters are enabled (as peft leaves them)
                    self._enable_adapters(True)

    @contextlib.contextmanager
    def calling(self, adapter: Adapter) -> Iterator[None]:
        """A call of ``adapter`` in progress, from its first step to its last: while it lasts the
        adapter is never offloaded (its gradients are held apart by the call, :mod:`.call_grads`),
        even while the call is paused and other clients' turns load theirs."""
        with self._lock:
            self._calls[adapter.name] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls[adapter.name] -= 1
                if self._calls[adapter.name] <= 0:
                    del self._calls[adapter.name]

    def _activate(self, adapter: Adapter | None) -> None:
        """(holding the turn) Make ``adapter`` the only active one, or disable every adapter."""
        self._enable_adapters(adapter is not None)
        if adapter is None:
            return
        adapter.last_used = next(self._clock)
        if adapter.offloaded is not None:
            self._reload(adapter)
        if self._active != adapter.name:
            self.module.set_adapter(adapter.name)
            self._active = adapter.name

    def _enable_adapters(self, enabled: bool) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if self._adapters_enabled == enabled or self.plain is None:
            return
        for layer in self.plain.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.enable_adapters(enabled)
        self._adapters_enabled = enabled

    # ---- capacity ---------------------------------------------------------------------------------
    def in_memory(self) -> list[Adapter]:
        with self._lock:
            return [a for a in self.adapters.values() if a.offloaded is None]

    def _evict_beyond_capacity(self, keep: Adapter) -> None:
        if self.max_adapters is None:
            return
        with self._lock:  # the turn's adapter, and every adapter with a call in progress, keep their tensors
            busy = set(self._calls) | ({self._holder.name} if self._holder is not None else set())
        resident = sorted((a for a in self.in_memory() if a is not keep and a.name not in busy),
                          key=lambda a: a.last_used)
        while resident and len(resident) + 1 > self.max_adapters:
            self._offload(resident.pop(0))

    def offload_dir(self) -> Path:
        if self._offload_root is None:
            self._offload_root = Path(tempfile.mkdtemp(prefix="skyrl-offload-"))
            self._own_offload_dir = True
        self._offload_root.mkdir(parents=True, exist_ok=True)
        return self._offload_root

    def _offload(self, adapter: Adapter) -> None:
        self._active = None
        t0 = time.perf_counter()
        file = self.offload_dir() / f"{adapter.name}.safetensors"
        offload.offload(adapter.runner, file)
        adapter.offloaded = file
        seconds = time.perf_counter() - t0
        self.offloads += 1
        self.offload_seconds += seconds
        logger.info("shared base %s: adapter %s offloaded to disk (%.3fs)", self.model_name, adapter.label, seconds)

    def _reload(self, adapter: Adapter) -> None:
        assert adapter.offloaded is not None  # called only for an offloaded adapter
        self._active = None
        self._evict_beyond_capacity(keep=adapter)
        t0 = time.perf_counter()
        offload.reload(adapter.runner, adapter.offloaded, self.device)
        adapter.offloaded = None
        seconds = time.perf_counter() - t0
        self.reloads += 1
        self.reload_seconds += seconds
        logger.info("shared base %s: adapter %s reloaded from disk (%.3fs)", self.model_name, adapter.label, seconds)

    # ---- visibility -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What is loaded: the base, each adapter (bytes in memory, or offloaded), offload counts.

        Any thread may ask, so it reads no tensor (see :attr:`Adapter.resident_bytes`)."""
        with self._lock:
            adapters = list(self.adapters.values())
        rows = [{
            "label": a.label, "adapter": a.name, "rank": a.lora.rank, "step": a.runner.optimizer.step_count,
            "offloaded": a.offloaded is not None,
            "bytes": 0 if a.offloaded is not None else a.resident_bytes,
        } for a in adapters]
        return {
            "model": self.model_name, "role": self.role, "dtype": self.config.dtype, "device": str(self.device),
            "base_parameters": self.base_parameters, "base_bytes": self.base_bytes,
            "adapters": rows, "adapters_in_memory": sum(not r["offloaded"] for r in rows),
            "adapter_bytes": sum(r["bytes"] for r in rows), "max_adapters": self.max_adapters,
            "offloads": self.offloads, "reloads": self.reloads,
            "offload_seconds": self.offload_seconds, "reload_seconds": self.reload_seconds,
        }

    # ---- lifetime ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise InputError(f"the shared base {self.model_name} is closed")

    def close(self) -> None:
        with self.gate.turn("close"):
            if self.closed:
                return
            self.closed = True
            for adapter in list(self.adapters.values()):
                adapter.closed = True
                adapter.runner.optimizer.release()
            self.adapters.clear()
            self.loaded.module = None
            self._peft = None
            self.plain = None
            self.scoring = None
            if self._own_offload_dir and self._offload_root is not None:
                shutil.rmtree(self._offload_root, ignore_errors=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

