"""Sampling sessions, the sampler-backend cache and weight snapshots.

A sampling session samples from a base model, a saved ``tinker://`` path, or a live
training model (``save_weights_and_get_sampling_client``). Base models and saved paths are
served by sampler Backends, loaded lazily, each with its own queue on the compute executor
(a base model's per owner, so owners take turns), the least recently used evicted past
``max_sampler_backends``. Queued requests that share every option (:func:`batch_key`) run
as one sampler call: one :class:`~skyrl_sdk.types.SampleRequest` holding all their prompts.

Weights versions: a training model's is its engine's (``Engine.weights_version``), which
grows with every ``optim_step`` that changed the weights and every ``load_weights``. An
ephemeral ``snapshot`` session pins the version it was created at and samples the live model
while it is still at that version; before the weights change, a pinned version is
snapshotted once, in memory through the engine's ``copy_trainable`` (:mod:`.snapshots`), and
its sessions then sample a sampler built from that snapshot (the last ``max_ephemeral_snapshots`` per model
are kept, within the ``snapshot_memory`` byte budget over all models). ``inflight``
sessions always sample the live weights.

Everything that reads the state dir (a session's record, a checkpoint's path and the headers
of its safetensors files) runs on a thread: the event loop never waits for the disk.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import threading
import uuid
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ...errors import InputError, NotFoundError, quoted
from ...inputs.coerce import lora_config_from_any
from ...models.weight_files import weights_problem
from ...types import ModelInput, SampleRequest
from ..config import ServerConfig
from ..state.store import Store
from ..wire import proto
from ..wire.envelopes import SampleSpec
from ..wire.tinker_paths import TinkerPath
from .executor import Executors, Queue
from .futures import Job, Result
from .served import RNG_LOCK, ServedModels
from .sessions import TrainingModel
from .snapshots import SnapshotCache, WeightsSnapshot, load_snapshot, take_snapshot

if TYPE_CHECKING:
    from ...backend import Backend


@attrs.define(eq=False)
class SamplingSession:
    sid: str
    owner: str
    base_model: str
    model_path: str | None
    kind: str  # "base" | "path" | "snapshot" | "inflight"
    model: TrainingModel | None = None
    version: int | None = None
    #: the client session it belongs to (where record_stability_info records; None: an ad-hoc sample)
    session_id: str | None = None

    def pinned_model(self) -> TrainingModel:
        """The training model a "snapshot" or "inflight" session samples (the others have none)."""
        if self.model is None:
            raise ValueError(f"sampling session {self.sid} ({self.kind}) samples no training model")
        return self.model


@attrs.frozen(eq=False)
class SampleWork:
    """A queued sample request: the request, and what records its sequences (None: nothing)."""

    spec: SampleSpec
    record: Callable[[Any], None] | None = None


def batch_key(target: Hashable, pinned_version: int | None, request: SampleRequest) -> Hashable | None:
    """The key under which queued sample requests run as one sampler call: the same sampler
    (``target``, and the weights version a snapshot session pins) and every option of the
    request (:meth:`SampleRequest.batch_key`, derived from its fields, so a new option is in
    it). None, alone: a seeded request (its draws are its own generator's) and a prompt with
    images (its images are read, and may be refused, in its own call)."""
    if request.sampling_params.seed is not None or any(isinstance(p, ModelInput) for p in request.prompts):
        return None
    return (target, pinned_version, request.batch_key())


@attrs.define(eq=False)
class SamplerTarget:
    """A Backend used only for sampling (a base model or saved weights), loaded lazily."""

    key: tuple
    worker: Queue
    loader: Callable[[], Any]
    #: whose request made it (what ``/api/v1/loaded`` shows whom: :mod:`.visibility`)
    owner: str = ""
    backend: Any = None

    def get(self) -> Backend:
        if self.backend is None:
            self.backend = self.loader()
        return self.backend


class Sampling:
    """Sampling sessions by id, and the cache of sampler Backends they run on."""

    def __init__(self, config: ServerConfig, store: Store, served: ServedModels, executors: Executors) -> None:
        self.config = config
        self.store = store
        self.served = served
        self.executors = executors
        self.sessions: dict[str, SamplingSession] = {}
        self._targets: collections.OrderedDict[tuple, SamplerTarget] = collections.OrderedDict()
        self._targets_lock = threading.Lock()
        self.snapshots = SnapshotCache(config.snapshot_memory)
        #: per training model whose sampler runs apart from its trainer: the queue of its samples,
        #: on an executor of its own, so they run while the model trains (Sampler.runs_apart)
        self._apart: dict[str, Queue] = {}

    def cached_samplers(self) -> int:
        """Sampler Backends cached for snapshots and checkpoints (at most ``max_sampler_backends``)."""
        with self._targets_lock:
            return len(self._targets)

    # ---- sessions -------------------------------------------------------------------------------
    async def create(self, owner: str, session_id: str | None, sid: str, model_path: Any, base_model: Any
                     ) -> SamplingSession:
        """A durable session on a base model or a saved path (survives a restart)."""
        if (old := self.sessions.get(sid)) is not None and old.owner != owner:
            raise NotFoundError(f"unknown session {quoted(session_id)}")
        session = await asyncio.to_thread(self.session_from, owner, model_path, base_model, sid)
        session = attrs.evolve(session, session_id=session_id)
        await asyncio.to_thread(self.store.add_sampling_session, sid, owner, session_id, session.base_model,
                                session.model_path)
        self.sessions[sid] = session
        return session

    def add_ephemeral(self, model: TrainingModel, sid: str, kind: str) -> None:
        """(the model's worker) A session on a live training model, pinning its weights if a snapshot."""
        model.require_backend()
        self.sessions[sid] = SamplingSession(sid, model.owner, model.base_model, None, kind, model=model,
                                             version=model.weights_version if kind == "snapshot" else None,
                                             session_id=model.session_id)
        if kind == "snapshot":
            model.pinned.add(model.weights_version)

    def session_from(self, owner: str, model_path: Any, base_model: Any, sid: str) -> SamplingSession:
        """(a thread: it reads the state dir) A session's target, checked."""
        if model_path:
            tp, directory = self.store.resolve_checkpoint(model_path, owner, readable=True)
            if tp.kind == "external":
                raise InputError(f"{model_path}: external weights are for download (RestClient."
                                 f"get_external_weights_urls); sample from a weights or sampler_weights path")
            # checked now (headers and sizes), so a damaged checkpoint is a user error naming it here,
            # not a server error inside the first sample
            if (problem := weights_problem(directory)) is not None:
                raise InputError(f"checkpoint {tp} cannot be sampled: {problem}; save it again")
            run = self.store.run(tp.run_id, None)  # the caller's, or another owner's published checkpoint
            if run is None:
                raise InputError(f"checkpoint {tp} cannot be sampled: its training run is gone")
            return SamplingSession(sid, owner, run["base_model"], str(tp), "path")
        if base_model:
            return SamplingSession(sid, owner, self.served.resolve(base_model), None, "base")
        raise InputError("sampling needs a model_path (tinker://...) or a base_model")

    async def session(self, owner: str, sid: Any) -> SamplingSession:
        """``owner``'s sampling session ``sid`` (another owner's reads as unknown)."""
        s = self.sessions.get(sid) if isinstance(sid, str) else None
        if s is None and isinstance(sid, str) and (s := await asyncio.to_thread(self._recorded, owner, sid)):
            self.sessions[sid] = s
        if s is None or s.owner != owner:
            raise NotFoundError(f"unknown sampling session {quoted(sid)} (ephemeral sampling sessions are lost "
                                f"when the server restarts)")
        return s

    def _recorded(self, owner: str, sid: str) -> SamplingSession | None:
        """(a thread) A path- or base-model session from its record: it survives a restart."""
        if (row := self.store.sampling_session(sid, owner)) is None:
            return None
        return attrs.evolve(self.session_from(owner, row["model_path"], row["base_model"], sid),
                            session_id=row["session_id"])

    def runs_sampled(self) -> list[tuple[str, str]]:
        """``(sampling session id, training run id)`` of this process's sessions on a run (its live
        weights or one of its checkpoints)."""
        out = []
        for sid, s in list(self.sessions.items()):
            if s.model is not None:
                out.append((sid, s.model.model_id))
            elif s.model_path and s.model_path.startswith("tinker://"):
                out.append((sid, s.model_path[len("tinker://"):].split("/", 1)[0]))
        return out

    def _queue_of(self, model: TrainingModel) -> Queue:
        """Where a live model's samples queue: its own worker, or, once its sampler runs apart from
        the trainer (``Sampler.runs_apart``: engines on devices of their own), a queue on an
        executor of its own."""
        sampler = model.backend.sampler if model.backend is not None else None
        if sampler is None or not sampler.runs_apart:
            return model.worker
        with self._targets_lock:
            queue = self._apart.get(model.model_id)
            if queue is None:
                queue = self._apart[model.model_id] = self.executors.queue(
                    f"{model.model_id}/samples", model.owner, self.config.max_sample_batch,
                    self.config.sample_batch_wait_s, dedicated=True)
            return queue

    def drop_snapshots(self, model: TrainingModel) -> None:
        """(the model's worker, on release) Drop its snapshots and their samplers; its sessions then fail."""
        with self._targets_lock:
            apart = self._apart.pop(model.model_id, None)
        if apart is not None:
            apart.close(wait=False)
        while model.snapshots:
            self._drop_snapshot(model, *model.snapshots.popitem(last=False))

    # ---- running samples ------------------------------------------------------------------------
    async def submit(self, session: SamplingSession, spec: SampleSpec, done: Callable[[Result], None],
                     record: Callable[[Any], None] | None = None) -> None:
        """Queue a sample request; ``record(output)`` records its sequences (record_stability_info).
        A saved path's sampler is found on a thread (its checkpoint's record and directory)."""
        spec.check_length(self.served.max_seq_len(session.base_model))
        work = SampleWork(spec, record)
        if session.kind in ("snapshot", "inflight"):
            model = session.pinned_model()
            if model.closed:
                raise InputError(f"sampling session {session.sid}: its model was released ({model.closed})")
            job = self._sample_job(work, done, lambda: model.require_backend(), ("model", model.model_id),
                                   session if session.kind == "snapshot" else None)
            self._queue_of(model).put(job)
            return
        target = self._target_for(session) if session.kind == "base" else \
            await asyncio.to_thread(self._target_for, session)
        target.worker.put(self._sample_job(work, done, target.get, target.key, None))

    def _sample_job(self, work: SampleWork, done: Callable[[Result], None], get_backend: Callable[[], Backend],
                    target_key: Hashable, snapshot: SamplingSession | None) -> Job:
        def stale() -> bool:
            return snapshot is not None and snapshot.pinned_model().weights_version != snapshot.version

        def reroute(jobs: list[Job]) -> list[Result | None]:
            assert snapshot is not None and snapshot.version is not None  # rerouted when stale(): a snapshot's
            model, v = snapshot.pinned_model(), snapshot.version
            if v in model.dropped or v not in model.snapshots:
                raise InputError(f"sampling session {snapshot.sid}: its weights snapshot was dropped (only the last "
                                 f"{self.config.max_ephemeral_snapshots} per model are kept); create a new "
                                 f"sampling client")
            target = self._snapshot_target(model, model.snapshots[v], snapshot.sid)
            for j in jobs:
                target.worker.put(self._sample_job(j.payload, j.done, target.get, target.key, None))
            return [None] * len(jobs)

        def run_batch(jobs: list[Job]) -> list[Result | None]:
            if stale():
                return reroute(jobs)
            specs = [j.payload.spec for j in jobs]
            backend = get_backend()
            with RNG_LOCK:
                outs = backend.sample_request(SampleRequest.batched([s.request for s in specs]))
            results: list[Result | None] = []
            for j, s in zip(jobs, specs, strict=True):  # one prompt, so one output, per job
                out, outs = outs[0], outs[1:]
                if j.payload.record is not None:
                    j.payload.record(out)
                results.append(Result.proto(proto.sample_output_to_proto(out, s.prompt_logprobs_last_n, s.request)))
            return results

        def run() -> Result | None:
            return run_batch([job])[0]

        spec = work.spec
        key = batch_key(target_key, snapshot.version if snapshot else None, spec.request)
        cost: int | None = spec.request.num_samples * (spec.prompt_length + spec.request.sampling_params.max_tokens)
        if isinstance(spec.prompt, ModelInput):  # images: decoding is work tokens do not count
            cost = None  # never run in another call's gap
        job = Job(run=run, done=done, what="sample", batch_key=key, run_batch=run_batch, payload=work, cost=cost)
        return job

    # ---- snapshots ------------------------------------------------------------------------------
    def before_weight_change(self, model: TrainingModel) -> None:
        """(the model's worker) Snapshot the current weights if an ephemeral session pins them:
        in memory, or on disk for an engine without memory snapshots or one too big for the budget."""
        v = model.weights_version
        if v not in model.pinned or v in model.snapshots:
            return
        snap = take_snapshot(model.model_id, model.backend, self.snapshots.max_bytes)
        if snap is not None:
            model.snapshots[v] = snap
            for old in self.snapshots.add(snap):  # evicted by the byte budget: their samplers go too
                self._evict(("memory", *old.key))
        else:
            directory = self.store.scratch_dir("snapshots", self.store.run_dirname(model.model_id), f"v{v}")
            if self._shares_snapshot(model):  # the adapter's state: its sampler is an adapter on the shared base
                model.backend.save_state(directory, overwrite=True)
            else:
                model.backend.save_weights_for_sampler(directory, overwrite=True)
            model.snapshots[v] = directory
        model.pinned.discard(v)
        while len(model.snapshots) > self.config.max_ephemeral_snapshots:
            old_v, old_snapshot = model.snapshots.popitem(last=False)
            model.dropped.add(old_v)
            self._drop_snapshot(model, old_v, old_snapshot)

    def _drop_snapshot(self, model: TrainingModel, version: int, snap: WeightsSnapshot | Path) -> None:
        if isinstance(snap, WeightsSnapshot):
            self.snapshots.remove(snap)
            self._evict(("memory", model.model_id, version))
            return
        self._evict(("dir", str(snap)))
        self._evict(("state", str(snap)))
        shutil.rmtree(snap, ignore_errors=True)

    def _shares_snapshot(self, model: TrainingModel) -> bool:
        return model.lora is not None and self.served.shares(model.base_model)

    def _snapshot_target(self, model: TrainingModel, snap: WeightsSnapshot | Path, sid: str) -> SamplerTarget:
        shared = self._shares_snapshot(model)
        if isinstance(snap, WeightsSnapshot):
            self.snapshots.tensors(snap, sid)  # fails now if evicted; marks it used

            def load() -> Backend:
                backend = self.served.sampler_backend(model.base_model, model.lora, own_copy=not shared)
                try:
                    load_snapshot(backend, self.snapshots.tensors(snap, sid))
                except BaseException:
                    backend.close()
                    raise
                return backend

            return self._target(("memory", *snap.key), load, model.owner)
        if shared:
            return self._target(("state", str(snap)), self._state_loader(model.base_model, snap, model.lora),
                                model.owner)
        return self._target(("dir", str(snap)), self._state_loader(str(snap)), model.owner)

    # ---- the sampler-backend cache --------------------------------------------------------------
    def _target_for(self, session: SamplingSession) -> SamplerTarget:
        owner = session.owner
        if session.kind == "base":  # the shared base itself (no copy): one per owner, so owners take turns
            return self._target(("base", session.base_model, owner), self._state_loader(session.base_model), owner)
        tp = TinkerPath.parse(session.model_path)
        _, directory = self.store.resolve_checkpoint(session.model_path, owner, readable=True)
        if tp.kind == "sampler":
            return self._target(("dir", str(directory)), self._state_loader(str(directory)), owner)
        run = self.store.run(tp.run_id, None)
        lora = lora_config_from_any(run["lora"]) if run else None
        return self._target(("state", str(directory)), self._state_loader(session.base_model, directory, lora), owner)

    def _state_loader(self, model: str, directory: Path | None = None, lora: Any = None) -> Callable[[], Any]:
        """A sampler of ``model`` (a served model or an exported directory), with a training state
        loaded from ``directory`` when given."""

        def load() -> Backend:
            if directory is None:
                return self.served.sampler_backend(model)
            backend = self.served.sampler_backend(model, lora, own_copy=lora is None)
            try:
                backend.load_state(directory, optimizer=False)
            except BaseException:
                backend.close()
                raise
            return backend

        return load

    def _target(self, key: tuple, load: Callable[[], Any], owner: str) -> SamplerTarget:
        """Get or create a sampler backend (safe from any thread: dict ops only)."""
        with self._targets_lock:
            target = self._targets.get(key)
            if target is not None:
                self._targets.move_to_end(key)
                return target
            worker = self.executors.queue(f"sampler-{uuid.uuid4().hex[:8]}", owner, self.config.max_sample_batch,
                                          self.config.sample_batch_wait_s)
            target = SamplerTarget(key, worker, load, owner)
            self._targets[key] = target
            evict = list(self._targets)[: max(0, len(self._targets) - self.config.max_sampler_backends)]
        for old_key in evict:
            self._evict(old_key)
        return target

    def targets(self) -> list[SamplerTarget]:
        """The sampler Backends' targets (any thread)."""
        with self._targets_lock:
            return list(self._targets.values())

    def _evict(self, key: tuple) -> None:
        with self._targets_lock:
            target = self._targets.pop(key, None)
        if target is None:
            return

        def close() -> Result:
            if target.backend is not None:
                target.backend.close()
                target.backend = None
            return Result.json({})

        target.worker.put(Job(run=close, done=lambda r: target.worker.close(wait=False), what="close sampler"))

    def close(self) -> None:
        """(server shutdown, the executors stopped) Close every sampler Backend."""
        for queue in list(self._apart.values()):
            queue.close(wait=False)
        for t in list(self._targets.values()):
            t.worker.close(wait=False)
            if t.backend is not None:
                t.backend.close()
