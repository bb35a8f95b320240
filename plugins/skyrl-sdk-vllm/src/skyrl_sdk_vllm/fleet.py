"""The controller's side of pushed vLLM engines: starting them, pushing the weights to every one,
spreading requests over them, restarting one that died.

**A push** (full fine-tuning after each weights change; a LoRA model's base once per engine):
the controller hosts one rendezvous store per engine (its transfer group: the trainer ranks,
then the engine's tensor-parallel workers), asks every engine to receive (``Replica.receive``:
vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) and, while they
wait, has the trainer send (``WeightsSource.push_weights``: each trainer rank sends its own rows,
:mod:`.transfer`). Nothing is written to disk. A LoRA adapter version goes to every engine as
tensors (``Replica.set_adapter``).

**Requests.** The distinct prompts of a call go to the engines least loaded at that moment
(pending prompts x samples x tokens): all the samples of one prompt (a GRPO group, or the same
prompt sent several times) on one engine, whose prefix cache holds its prompt once.

**Failures.** An engine whose process died fails the call it served with ``EngineError`` naming
it; it is restarted at the next call (groups are rebuilt, every engine gets the weights again),
which is then served. A push that failed stops every engine that did not finish receiving (a
half-loaded engine must not serve); they are restarted the same way.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from skyrl_sdk.errors import EngineError
from skyrl_sdk.plugins.weight_push import PushLayout, PushTarget
from skyrl_sdk.sampling import SampleRequest, WeightsSource
from skyrl_sdk.types import SampleOutput

from .handles import EngineGone
from .placement import PlacementConfig

logger = logging.getLogger(__name__)
_fleet_ids = itertools.count(1)
#: the sender of each transport, built on every trainer rank (skyrl_sdk.plugins.weight_push)
SENDERS = {"gloo": "skyrl_sdk_vllm.transfer:GlooSender", "nccl": "skyrl_sdk_vllm.nccl_push:NcclSender"}
#: after a failed push, how long the engines still receiving get to finish before they are stopped
PUSH_GRACE_S = 10.0


@attrs.define(eq=False)
class Slot:
    """One engine: its handle (None: to be started), what it holds, what it is serving."""

    index: int
    handle: Any = None
    weights: int | None = None  # the weights version it holds (full fine-tuning; LoRA: the base, 0)
    adapter: int | None = None  # the adapter version it holds (LoRA)
    load: float = 0.0  # pending work: prompts x samples x tokens
    init_info: dict | None = None  # its group's init info, not yet received


class Fleet:
    """Pushed engines of one sampler (see the module docstring)."""

    def __init__(self, source: WeightsSource, placement: PlacementConfig, start: Callable[[int], Any],
                 backend: str, wire_dtype: str, trainer_host: str) -> None:
        self.source, self.placement, self.backend = source, placement, backend
        self._start, self.wire_dtype, self.host = start, wire_dtype, trainer_host
        self.id = next(_fleet_ids)
        self.generation = 0
        self.slots = [Slot(i) for i in range(placement.engines)]
        self.lock = threading.RLock()  # syncs and restarts; sampling runs outside it
        self.load_lock = threading.Lock()
        self.stores: list[Any] = []
        #: the last push or adapter sync: {"kind", "seconds", "bytes", "version"}
        self.last_sync: dict[str, Any] | None = None
        self.closed = False
        self._engine_line: str | None = None

    # ---- engines ------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """(holding the lock) Start every engine that is not running (in parallel threads)."""
        missing = [s for s in self.slots if s.handle is None]
        if not missing:
            return
        errors: dict[int, BaseException] = {}

        def start(slot: Slot) -> None:
            try:
                slot.handle = self._start(slot.index)
            except BaseException as exc:  # reported below, by engine
                errors[slot.index] = exc

        threads = [threading.Thread(target=start, args=(s,)) for s in missing]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            index, exc = min(errors.items())
            raise exc if not isinstance(exc, EngineGone) else EngineError(f"vllm engine {index} did not start: {exc}")
        for s in missing:
            s.weights = s.adapter = None
        self._new_groups()

    def _new_groups(self) -> None:
        """One transfer group per engine, rendezvous hosted here; every engine joins its new group
        at the next push (its ``init_info``), every trainer rank builds a new sender."""
        import torch.distributed as dist

        self.generation += 1
        self.stores = []
        ranks = self.source.push_layout(self.wire_dtype, gathered=self.backend == "nccl").ranks
        for slot in self.slots:
            store = dist.TCPStore(self.host, 0, None, True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=self.placement.transfer_timeout_s))
            self.stores.append(store)
            world = (1 if self.backend == "nccl" else ranks) + self.placement.tensor_parallel_size
            slot.init_info = self._init_info(store.port, slot.index, ranks, world)
            slot.weights = None

    def _init_info(self, port: int, index: int, ranks: int, world: int) -> dict[str, Any]:
        if self.backend == "nccl":
            return {"master_address": self.host, "master_port": port, "rank_offset": 1, "world_size": world,
                    "packed": False}
        return {"host": self.host, "port": port, "prefix": self._prefix(index),
                "trainer_ranks": ranks, "world_size": world, "timeout_s": self.placement.transfer_timeout_s}

    def _prefix(self, index: int) -> str:
        return f"skyrl/{self.id}/{self.generation}/{index}/"

    def _target(self) -> PushTarget:
        options: dict[str, Any]
        if self.backend == "nccl":
            options = {"groups": [{"host": self.host, "port": st.port,
                                   "world_size": 1 + self.placement.tensor_parallel_size} for st in self.stores],
                       "timeout_s": self.placement.transfer_timeout_s}
        else:
            ranks = self.source.push_layout(self.wire_dtype).ranks
            options = {"groups": [{"host": self.host, "port": st.port, "prefix": self._prefix(i),
                                   "world_size": ranks + self.placement.tensor_parallel_size}
                                  for i, st in enumerate(self.stores)],
                       "trainer_ranks": ranks, "timeout_s": self.placement.transfer_timeout_s,
                       "bucket_bytes": self.placement.bucket_bytes}
        return PushTarget(sender=SENDERS[self.backend], options=options, key=f"skyrl-vllm-fleet-{self.id}",
                          generation=self.generation)

    def _update_info(self, layout: PushLayout) -> dict[str, Any]:
        if self.backend == "nccl":
            return {"names": [t.name for t in layout.tensors], "dtype_names": [t.dtype for t in layout.tensors],
                    "shapes": [list(t.shape) for t in layout.tensors]}
        return {"layout": layout.to_plain(), "bucket_bytes": self.placement.bucket_bytes}

    def _lost(self, slot: Slot, why: str) -> None:
        """Stop an engine that died or cannot be trusted; it is started again at the next call."""
        handle, slot.handle = slot.handle, None
        slot.weights = slot.adapter = None
        if handle is not None:
            logger.warning("%s: %s; it is restarted at the next call", handle.name, why)
            try:
                handle.kill()
            except Exception:  # it is gone either way
                pass

    # ---- weights ------------------------------------------------------------------------
    def sync(self) -> None:
        """Bring every engine to the source's current weights (starting any that is missing)."""
        with self.lock:
            self.ensure_started()
            lora = self.source.lora is not None
            target_version = 0 if lora else self.source.version
            stale = [s for s in self.slots if s.weights != target_version]
            if stale:
                self._push(target_version, "base" if lora else "full")
            if lora:
                behind = [s for s in self.slots if s.adapter != self.source.version]
                if behind:
                    self._send_adapter(behind)

    def current(self) -> bool:
        """Whether every engine runs and holds the source's current weights (no lock: a read)."""
        lora = self.source.lora is not None
        version = self.source.version
        return all(s.handle is not None and s.weights == (0 if lora else version)
                   and (not lora or s.adapter == version) for s in self.slots)

    def _push(self, version: int, kind: str) -> None:
        layout = self.source.push_layout(self.wire_dtype, gathered=self.backend == "nccl")
        update = self._update_info(layout)
        t0 = time.perf_counter()
        calls = [(s, s.handle.call("receive", s.init_info, update, version)) for s in self.slots]
        try:
            self.source.push_weights(self._target(), layout)
        except BaseException as exc:
            self._after_failed_push(calls, exc)
            raise
        failed = []
        for slot, call in calls:
            try:
                call.result()
                slot.weights, slot.init_info = version, None
            except EngineGone as exc:
                failed.append(str(exc))
                self._lost(slot, "died while receiving the weights")
        if failed:
            self._new_groups_if_running()
            raise EngineError("; ".join(failed) + " (restarted at the next call)")
        self.last_sync = {"kind": kind, "seconds": time.perf_counter() - t0, "bytes": layout.nbytes() * len(self.slots),
                          "version": self.source.version, "engines": len(self.slots), "transfer": self.backend}

    def _after_failed_push(self, calls: list[tuple[Slot, Any]], exc: BaseException) -> None:
        deadline = time.monotonic() + PUSH_GRACE_S
        names = []
        for slot, call in calls:
            try:
                call.result(timeout=max(0.0, deadline - time.monotonic()))
            except EngineGone as gone:
                names.append(str(gone))
                self._lost(slot, "died while receiving the weights")
            except Exception:  # stuck or failed mid-receive: half-loaded, not to be trusted
                self._lost(slot, f"did not finish receiving the weights ({type(exc).__name__})")
        for slot in self.slots:
            if slot.handle is not None:
                slot.weights = None
        if names:
            raise EngineError("; ".join(names) + " (restarted at the next call)") from exc
        self._new_groups_if_running()

    def _new_groups_if_running(self) -> None:
        if all(s.handle is not None for s in self.slots):
            self._new_groups()

    def _send_adapter(self, slots: list[Slot]) -> None:
        t0 = time.perf_counter()
        version = self.source.version
        adapter = self.source.adapter_weights()
        calls = [(s, s.handle.call("set_adapter", version, adapter)) for s in slots]
        for slot, call in calls:
            try:
                call.result()
                slot.adapter = version
            except EngineGone as exc:
                self._lost(slot, "died")
                raise EngineError(f"{exc} (restarted at the next call)") from None
        self.last_sync = {"kind": "lora", "seconds": time.perf_counter() - t0, "version": version,
                          "bytes": sum(t.numel() * t.element_size() for t in adapter.tensors.values()) * len(slots),
                          "engines": len(slots), "transfer": "ray" if self.placement.placement == "ray" else "memory"}

    def before_training(self) -> None:
        """The trainer computes next: every running engine sleeps (its ``sleep_level``), once per turn."""
        with self.lock:
            handles = [s.handle for s in self.slots if s.handle is not None]
        for call in [h.call("before_training") for h in handles]:
            call.result()

    # ---- requests -----------------------------------------------------------------------
    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        """Spread ``request``'s distinct prompts over the engines and put the answers back in order."""
        keys = [np.asarray(p, dtype=np.int64).tobytes() for p in request.prompts]
        order = list(dict.fromkeys(keys))
        drawn = request.sampling_params.max_tokens * request.num_samples
        cost = {k: (len(k) // 8) + drawn * keys.count(k) for k in order}
        with self.lock:
            slots = [s for s in self.slots if s.handle is not None]
        if not slots:
            raise EngineError("no vllm engine is running")
        assigned: dict[int, list[bytes]] = {}
        with self.load_lock:
            for k in sorted(order, key=lambda k: -cost[k]):
                slot = min(slots, key=lambda s: s.load)
                slot.load += cost[k]
                assigned.setdefault(slot.index, []).append(k)
        calls = []
        for slot in slots:
            mine = set(assigned.get(slot.index, ()))
            if not mine:
                continue
            positions = [i for i, k in enumerate(keys) if k in mine]
            part = _subrequest(request, positions)
            calls.append((slot, positions, sum(cost[k] for k in mine), slot.handle.call("sample", part)))
        outputs: list[SampleOutput | None] = [None] * len(keys)
        failure: Exception | None = None
        for slot, positions, load, call in calls:
            try:
                for i, out in zip(positions, call.result(), strict=True):
                    outputs[i] = out
            except EngineGone as exc:
                with self.lock:
                    self._lost(slot, "died while sampling")
                failure = failure or EngineError(f"{exc} (restarted at the next call)")
            except Exception as exc:  # the first error is raised after every call ended
                failure = failure or exc
            finally:
                with self.load_lock:
                    slot.load -= load
        if failure is not None:
            raise failure
        return outputs  # type: ignore[return-value]

    def describe(self) -> str:
        """One line (the engine's own line is asked once: an engine answers one call at a time)."""
        with self.lock:
            running = [s.handle for s in self.slots if s.handle is not None]
            if self._engine_line is None and running:
                self._engine_line = running[0].call("describe").result()
        first = self._engine_line or "vllm"
        where = "Ray actors" if self.placement.placement == "ray" else running[0].name if running else "?"
        tp = self.placement.tensor_parallel_size
        return (f"{first.split(' (')[0]} x{len(self.slots)} ({where}; weights pushed: {self.backend}"
                f"{f', tp {tp}' if tp > 1 else ''}{', colocated' if self.placement.colocate else ''})")

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for slot in self.slots:
                handle, slot.handle = slot.handle, None
                if handle is not None:
                    try:
                        handle.call("close").result(timeout=60)
                    except Exception:  # stopped below either way
                        pass
                    handle.kill()
            self.stores = []


def _subrequest(request: SampleRequest, positions: list[int]) -> SampleRequest:
    targets = request.target_prompt_logprobs
    part = None if targets is None else [targets[i] for i in positions]
    return attrs.evolve(request, prompts=[request.prompts[i] for i in positions],
                        target_prompt_logprobs=None if part is None or all(t is None for t in part) else part)
