"""The live server state: training models (one Backend + worker each), sampling sessions,
sampler backends, and the jobs that run Tinker's requests on them.

Route handlers (event loop) call into :class:`Runtime`; every Backend call happens on the
owning model's :class:`~.futures.Worker` thread, so the event loop never blocks on compute
and different models progress concurrently.

Weights versions: a training model's ``version`` grows with every ``optim_step`` and
``load_weights``. An ephemeral sampling session (``save_weights_and_get_sampling_client``)
pins the version it was created at and samples the live model while it is still at that
version; before the weights change, a pinned version is exported once to a scratch HF
directory that its sessions then sample from (the last ``max_ephemeral_snapshots`` per
model are kept).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import attrs

from ..errors import InputError
from ..serde import adam_params_from_any, lora_config_from_any
from ..types import LoraConfig
from . import wire
from .config import ServerConfig
from .futures import FutureRecord, FutureStore, Job, Result, Sequencer, Worker
from .store import Store, TinkerPath, check_name

logger = logging.getLogger(__name__)

#: torch's default RNG is process-wide: model initialisation (``tiny``, LoRA adapters) and
#: sampling seed and draw from it, so those run one at a time across all workers (or two
#: models created at once would get interleaved draws). Training draws no random numbers
#: and runs concurrently.
RNG_LOCK = threading.RLock()


class UnknownError(InputError):
    """A model, sampler or request id this server does not know (HTTP 404 on direct routes)."""


@attrs.define(eq=False)
class TrainingModel:
    model_id: str
    session_id: str | None
    base_model: str
    lora: LoraConfig | None
    worker: Worker
    sequencer: Sequencer
    ready: asyncio.Event
    backend: Any = None
    error: str | None = None
    version: int = 0
    pinned: set = attrs.Factory(set)
    snapshots: "collections.OrderedDict[int, Path]" = attrs.Factory(collections.OrderedDict)
    dropped: set = attrs.Factory(set)
    closed: bool = False

    def require_backend(self):
        if self.closed:
            raise InputError(f"model {self.model_id} was released (its session finished)")
        if self.backend is None:
            raise InputError(f"model {self.model_id} could not be created: {self.error or 'unknown error'}")
        return self.backend


@attrs.define(eq=False)
class SamplerTarget:
    """A Backend used only for sampling (a base model or saved weights), loaded lazily."""

    key: tuple
    worker: Worker
    loader: Callable[[], Any]
    backend: Any = None

    def get(self):
        if self.backend is None:
            self.backend = self.loader()
        return self.backend


@attrs.define(eq=False)
class SamplingSession:
    sid: str
    base_model: str
    model_path: str | None
    kind: str  # "base" | "path" | "snapshot" | "inflight"
    model: TrainingModel | None = None
    version: int | None = None


class Runtime:
    def __init__(self, config: ServerConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.loop = loop
        self.store = Store(config.state_dir)
        self.futures = FutureStore(loop)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self._targets: "collections.OrderedDict[tuple, SamplerTarget]" = collections.OrderedDict()
        self._targets_lock = threading.Lock()
        self._served = {self._canonical(m): m for m in config.models}
        self.started_at = time.time()
        if (n := self.store.delete_expired()):
            logger.info("deleted %d expired checkpoints", n)

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _canonical(name: str) -> str:
        if name == "tiny":
            return name
        p = Path(name).expanduser()
        return str(p.resolve()) if p.exists() else name.rstrip("/")

    def served_model(self, name: Any) -> str:
        """The ``--model`` entry a client's ``base_model`` names."""
        if not isinstance(name, str) or not name:
            raise InputError(f"base_model: expected a model name, got {name!r}")
        found = self._served.get(self._canonical(name))
        if found is None:
            raise InputError(f"base model {name!r} is not served here; this server serves {list(self.config.models)}")
        return found

    def _backend(self, model: str, lora: LoraConfig | None):
        from ..backend import Backend

        with RNG_LOCK:
            return Backend(model=model, engine=self.config.engine, engine_config=self.config.engine_config,
                           lora=lora, seed=self.config.seed)

    def model(self, model_id: Any) -> TrainingModel:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None:
            raise UnknownError(
                f"unknown model_id {model_id!r}: this server has no such model (models live in memory and are "
                f"lost when the server restarts; recreate it with create_training_client_from_state)"
            )
        return m

    def _new_model(self, model_id: str, session_id: str | None, base_model: str, lora: LoraConfig | None
                   ) -> TrainingModel:
        old = self.models.get(model_id)
        if old is not None and not old.closed:
            raise InputError(f"model {model_id} already exists")
        worker = Worker(model_id, self.config.max_sample_batch)
        model = TrainingModel(model_id, session_id, base_model, lora, worker,
                              Sequencer(worker, 1, self.config.gap_timeout_s), asyncio.Event())
        self.models[model_id] = model
        return model

    def _set_ready(self, model: TrainingModel) -> None:
        try:
            self.loop.call_soon_threadsafe(model.ready.set)
        except RuntimeError:  # the loop is closed: the server has shut down
            pass

    def finished(self, rec: FutureRecord, result: Result) -> None:
        self.futures.finish(rec, result)

    # ---- sessions -----------------------------------------------------------------------
    def create_session(self, body: dict) -> str:
        sid = f"sess-{uuid.uuid4().hex[:16]}"
        self.store.add_session(sid, body.get("tags"), body.get("user_metadata"), body.get("sdk_version"))
        return sid

    def finish_session(self, session_id: str, reason: Any) -> None:
        self.store.finish_session(session_id, reason)
        for model in list(self.models.values()):
            if model.session_id == session_id and not model.closed:
                self._release(model)

    def _release(self, model: TrainingModel) -> None:
        """Free a model's memory once its queued work is done."""

        def close() -> Result:
            model.closed = True
            if model.backend is not None:
                model.backend.close()
                model.backend = None
            for d in model.snapshots.values():
                shutil.rmtree(d, ignore_errors=True)
            return Result.json({})

        model.sequencer.fail_pending(f"model {model.model_id} was released (its session finished)")
        model.worker.put(Job(run=close, done=lambda r: model.worker.close(wait=False), what="release"))

    # ---- model creation -----------------------------------------------------------------
    def create_model(self, body: dict) -> FutureRecord:
        session_id, seq = body.get("session_id"), body.get("model_seq_id")
        if not isinstance(session_id, str) or not isinstance(seq, int):
            raise InputError("create_model: needs session_id (string) and model_seq_id (integer)")
        model_id = f"{session_id}:train:{seq}"
        dedup = ("create_model", model_id)
        if (old := self.futures.lookup(dedup)) is not None:
            return old
        rec = self.futures.create(model_id, dedup)
        try:
            base = self.served_model(body.get("base_model"))
            opt = body.get("optimizer_config") or {}
            if isinstance(opt, dict) and opt.get("type", "adamw") != "adamw":
                raise InputError(f"optimizer {opt.get('type')!r} is not supported; skyrl-sdk trains with AdamW")
            lora = lora_config_from_any(body.get("lora_config"))
            model = self._new_model(model_id, session_id, base, lora)
        except InputError as exc:
            self.finished(rec, Result.from_exception(exc))
            return rec
        self.store.add_session(session_id, None, None, None)  # known after a restart, too
        self.store.add_run(model_id, session_id, base, attrs.asdict(lora) if lora else None, body.get("user_metadata"))
        done = self.futures.completer(rec)

        def create() -> Result:
            try:
                model.backend = self._backend(base, lora)
            except BaseException as exc:
                model.error = str(exc)
                raise
            finally:
                self._set_ready(model)
            return Result.json({"model_id": model_id, "type": "create_model"})

        model.worker.put(Job(run=create, done=done, what=f"create_model({model_id})"))
        return rec

    def load_weights(self, body: dict) -> FutureRecord:
        """Create-from-state (session_id + model_seq_id) or a load into an existing model."""
        if body.get("session_id") is not None:
            return self._create_from_state(body)
        model_id, seq = body.get("model_id"), body.get("seq_id")
        dedup = ("seq", model_id, seq) if seq is not None else None
        if (old := self.futures.lookup(dedup)) is not None:
            return old
        rec = self.futures.create(model_id, dedup)
        try:
            model = self.model(model_id)
            _, directory = self.store.resolve_checkpoint(body.get("path"), kind="training")
        except InputError as exc:
            self.finished(rec, Result.from_exception(exc))
            return rec
        optimizer = bool(body.get("optimizer", False))
        path = body.get("path")

        def load() -> Result:
            backend = model.require_backend()
            self._before_weight_change(model)
            backend.load_state(directory, optimizer=optimizer)
            model.version += 1
            return Result.json({"path": path, "model_id": model.model_id, "type": "load_weights"})

        model.sequencer.submit(seq, Job(run=load, done=self.futures.completer(rec), what="load_weights"))
        return rec

    def _create_from_state(self, body: dict) -> FutureRecord:
        session_id, seq = body.get("session_id"), body.get("model_seq_id")
        model_id = f"{session_id}:train:{seq}"
        dedup = ("create_model", model_id)
        if (old := self.futures.lookup(dedup)) is not None:
            return old
        rec = self.futures.create(model_id, dedup)
        try:
            if not isinstance(session_id, str) or not isinstance(seq, int):
                raise InputError("load_weights: needs session_id (string) and model_seq_id (integer)")
            tp, directory = self.store.resolve_checkpoint(body.get("path"), kind="training")
            run = self.store.run(tp.run_id)
            if run is None:
                raise InputError(f"{body.get('path')}: its training run is not recorded on this server")
            base = self.served_model(body.get("base_model") or run["base_model"])
            lora = lora_config_from_any(run["lora"])
            model = self._new_model(model_id, session_id, base, lora)
        except InputError as exc:
            self.finished(rec, Result.from_exception(exc))
            return rec
        optimizer = bool(body.get("optimizer", False))
        self.store.add_session(session_id, None, None, None)
        self.store.add_run(model_id, session_id, base, run["lora"], body.get("user_metadata") or run["user_metadata"])
        path = body.get("path")

        def create() -> Result:
            try:
                backend = self._backend(base, lora)
                try:
                    backend.load_state(directory, optimizer=optimizer)
                except BaseException:
                    backend.close()
                    raise
                model.backend = backend
            except BaseException as exc:
                model.error = str(exc)
                raise
            finally:
                self._set_ready(model)
            return Result.json({"model_id": model_id, "path": path, "type": "load_weights"})

        model.worker.put(Job(run=create, done=self.futures.completer(rec), what=f"load_weights({model_id})"))
        return rec

    async def get_info(self, model_id: Any) -> dict:
        model = self.model(model_id)
        await asyncio.wait_for(model.ready.wait(), timeout=3600)
        info = model.require_backend().get_info()
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {"arch": info.architecture, "model_name": model.base_model,
                           "tokenizer_id": info.tokenizer_dir},
            "optimizer_config": {"type": "adamw"},
            "is_lora": info.is_lora,
            "lora_rank": info.lora_rank,
            "model_name": model.base_model,
        }

    # ---- training requests (sequenced per model) -------------------------------------------
    def _sequenced(self, model_id: Any, seq: Any, what: str, make_run: Callable[[TrainingModel], Callable[[], Result]]
                   ) -> FutureRecord:
        seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else None
        dedup = ("seq", model_id, seq) if seq is not None and isinstance(model_id, str) else None
        if (old := self.futures.lookup(dedup)) is not None:
            logger.info("%s: (model %s, seq_id %s) was already submitted; returning %s", what, model_id, seq,
                        old.request_id)
            return old
        rec = self.futures.create(model_id if isinstance(model_id, str) else None, dedup)
        try:
            model = self.model(model_id)
            run = make_run(model)
        except InputError as exc:
            self.finished(rec, Result.from_exception(exc))
            return rec
        self.store.touch_run(model.model_id)
        model.sequencer.submit(seq, Job(run=run, done=self.futures.completer(rec), what=f"{what}({model_id})"))
        return rec

    def forward_backward(self, req: wire.FwdBwdRequest) -> FutureRecord:
        def make(model: TrainingModel):
            def run() -> Result:
                backend = model.require_backend()
                if req.error is not None:
                    raise InputError(req.error)
                fn = backend.forward if req.forward_only else backend.forward_backward
                out = fn(req.data, loss_fn=req.loss_fn, loss_fn_config=req.loss_fn_config)
                return Result.proto(wire.forward_backward_output_to_proto(out))

            return run

        return self._sequenced(req.model_id, req.seq_id, "forward" if req.forward_only else "forward_backward", make)

    def optim_step(self, body: dict) -> FutureRecord:
        def make(model: TrainingModel):
            if body.get("optimizer_params") is not None:
                raise InputError("only AdamW (adam_params) is supported by skyrl-sdk serve")
            raw = body.get("adam_params", body.get("optim_params"))
            if raw is not None and not isinstance(raw, dict):
                raise InputError(f"adam_params: expected an object, got {type(raw).__name__}")
            fields = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
            unknown = sorted(set(raw or {}) - set(fields) - {"type"})
            if unknown:
                raise InputError(f"adam_params: unknown keys {unknown}; accepted: {list(fields)}")
            params = adam_params_from_any({k: v for k, v in (raw or {}).items() if k in fields})

            def run() -> Result:
                backend = model.require_backend()
                self._before_weight_change(model)
                out = backend.optim_step(params)
                model.version += 1
                return Result.json({"metrics": {k: float(v) for k, v in out.metrics.items()}})

            return run

        return self._sequenced(body.get("model_id"), body.get("seq_id"), "optim_step", make)

    def save_weights(self, body: dict) -> FutureRecord:
        def make(model: TrainingModel):
            tp = TinkerPath(model.model_id, "training", check_name(body.get("path")))
            directory = self.store.checkpoint_dir(tp)
            overwrite = bool(body.get("overwrite", False))

            def run() -> Result:
                self.store.delete_expired()
                model.require_backend().save_state(directory, overwrite=overwrite)
                self.store.add_checkpoint(tp, body.get("ttl_seconds"), body.get("user_metadata"))
                return Result.json({"path": str(tp), "type": "save_weights"})

            return run

        return self._sequenced(body.get("model_id"), body.get("seq_id"), "save_weights", make)

    def save_weights_for_sampler(self, body: dict) -> FutureRecord:
        def make(model: TrainingModel):
            if body.get("path") is not None:
                tp = TinkerPath(model.model_id, "sampler", check_name(body.get("path")))
                directory = self.store.checkpoint_dir(tp)

                def run_named() -> Result:
                    model.require_backend().save_weights_for_sampler(directory, overwrite=True)
                    self.store.add_checkpoint(tp, body.get("ttl_seconds"), body.get("user_metadata"))
                    return Result.json({"path": str(tp), "type": "save_weights_for_sampler"})

                return run_named
            seq = body.get("sampling_session_seq_id")
            if not isinstance(seq, int):
                raise InputError("save_weights_for_sampler: needs a path (a name) or a sampling_session_seq_id")
            kind = body.get("kind") or "snapshot"
            if kind not in ("snapshot", "inflight"):
                raise InputError(f"save_weights_for_sampler: unknown kind {kind!r} (snapshot or inflight)")
            sid = f"{model.session_id}:sample:{seq}"

            def run_ephemeral() -> Result:
                model.require_backend()
                session = SamplingSession(sid, model.base_model, None, kind, model=model,
                                          version=model.version if kind == "snapshot" else None)
                if kind == "snapshot":
                    model.pinned.add(model.version)
                self.samplers[sid] = session
                return Result.json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

            return run_ephemeral

        return self._sequenced(body.get("model_id"), body.get("seq_id"), "save_weights_for_sampler", make)

    def _before_weight_change(self, model: TrainingModel) -> None:
        """(worker thread) Export the current weights if an ephemeral session pins them."""
        v = model.version
        if v not in model.pinned or v in model.snapshots:
            return
        directory = self.store.scratch_dir("snapshots", self.store.run_dirname(model.model_id), f"v{v}")
        model.backend.save_weights_for_sampler(directory, overwrite=True)
        model.snapshots[v] = directory
        model.pinned.discard(v)
        while len(model.snapshots) > self.config.max_ephemeral_snapshots:
            old_v, old_dir = model.snapshots.popitem(last=False)
            model.dropped.add(old_v)
            self._evict_target(("dir", str(old_dir)))
            shutil.rmtree(old_dir, ignore_errors=True)

    # ---- sampling -------------------------------------------------------------------------
    def create_sampling_session(self, body: dict) -> str:
        session_id, seq = body.get("session_id"), body.get("sampling_session_seq_id")
        if not isinstance(session_id, str) or not isinstance(seq, int):
            raise InputError("create_sampling_session: needs session_id and sampling_session_seq_id")
        sid = f"{session_id}:sample:{seq}"
        session = self._session_from(body.get("model_path"), body.get("base_model"), sid)
        self.samplers[sid] = session
        self.store.add_sampling_session(sid, session_id, session.base_model, session.model_path)
        return sid

    def _session_from(self, model_path: Any, base_model: Any, sid: str) -> SamplingSession:
        if model_path:
            tp, _ = self.store.resolve_checkpoint(model_path)
            run = self.store.run(tp.run_id)
            if run is None:
                raise InputError(f"{model_path}: its training run is not recorded on this server")
            return SamplingSession(sid, run["base_model"], str(tp), "path")
        if base_model:
            return SamplingSession(sid, self.served_model(base_model), None, "base")
        raise InputError("sampling needs a model_path (tinker://...) or a base_model")

    def sampler(self, sid: Any) -> SamplingSession:
        s = self.samplers.get(sid) if isinstance(sid, str) else None
        if s is None and isinstance(sid, str) and (row := self.store.sampling_session(sid)) is not None:
            # a path- or base-model session survives a restart
            s = self._session_from(row["model_path"], row["base_model"], sid)
            self.samplers[sid] = s
        if s is None:
            raise UnknownError(f"unknown sampling session {sid!r} (ephemeral sampling sessions are lost when the "
                               f"server restarts)")
        return s

    def sample(self, body: dict) -> tuple[FutureRecord, int]:
        sid, seq = body.get("sampling_session_id"), body.get("seq_id")
        dedup = ("sample", sid, seq) if isinstance(sid, str) and isinstance(seq, int) else None
        if (old := self.futures.lookup(dedup)) is not None:
            return old, old.extra.get("num_samples", 0)
        rec = self.futures.create(None, dedup, prefix="sample")
        n = body.get("num_samples", 1)
        rec.extra["num_samples"] = n if isinstance(n, int) and n > 0 else 0
        try:
            spec = wire.parse_sample_request(body)
            session = self.sampler(sid) if sid is not None else self._session_from(
                body.get("model_path"), body.get("base_model"), "adhoc")
            self._submit_sample(session, spec, self.futures.completer(rec))
        except InputError as exc:
            self.finished(rec, Result.from_exception(exc))
        return rec, rec.extra["num_samples"]

    def _submit_sample(self, session: SamplingSession, spec: wire.SampleSpec, done: Callable[[Result], None]) -> None:
        if session.kind in ("snapshot", "inflight"):
            model = session.model
            if model.closed:
                raise InputError(f"sampling session {session.sid}: its model was released (session finished)")
            job = self._sample_job(spec, done, lambda: model.require_backend(), ("model", model.model_id),
                                   session if session.kind == "snapshot" else None)
            model.worker.put(job)
            return
        target = self._target_for(session)
        target.worker.put(self._sample_job(spec, done, target.get, target.key, None))

    def _sample_job(self, spec: wire.SampleSpec, done, get_backend, target_key, snapshot: SamplingSession | None
                    ) -> Job:
        def stale() -> bool:
            return snapshot is not None and snapshot.model.version != snapshot.version

        def reroute(jobs: list[Job]) -> list[None]:
            model, v = snapshot.model, snapshot.version
            if v in model.dropped or v not in model.snapshots:
                raise InputError(f"sampling session {snapshot.sid}: its weights snapshot was dropped (only the last "
                                 f"{self.config.max_ephemeral_snapshots} per model are kept); create a new "
                                 f"sampling client")
            target = self._target_sync(("dir", str(model.snapshots[v])), str(model.snapshots[v]), None)
            for j in jobs:
                target.worker.put(self._sample_job(j.payload, j.done, target.get, target.key, None))
            return [None] * len(jobs)

        def run_batch(jobs: list[Job]) -> list[Result | None]:
            if stale():
                return reroute(jobs)
            first = jobs[0].payload
            backend = get_backend()
            with RNG_LOCK:
                outs = backend.sample([j.payload.prompt for j in jobs], first.params, first.num_samples,
                                      first.prompt_logprobs)
            return [Result.proto(wire.sample_output_to_proto(o, j.payload.prompt_logprobs_last_n))
                    for o, j in zip(outs, jobs)]

        def run() -> Result | None:
            return run_batch([job])[0]

        key = None
        if spec.params.seed is None:
            key = (target_key, snapshot.version if snapshot else None, spec.params, spec.num_samples,
                   spec.prompt_logprobs)
        job = Job(run=run, done=done, what="sample", batch_key=key, run_batch=run_batch, payload=spec)
        return job

    def _target_for(self, session: SamplingSession) -> SamplerTarget:
        if session.kind == "base":
            return self._target_sync(("base", session.base_model), session.base_model, None)
        tp = TinkerPath.parse(session.model_path)
        _, directory = self.store.resolve_checkpoint(session.model_path)
        if tp.kind == "sampler":
            return self._target_sync(("dir", str(directory)), str(directory), None)
        run = self.store.run(tp.run_id)
        return self._target_sync(("state", str(directory)), session.base_model,
                                 (directory, lora_config_from_any(run["lora"]) if run else None))

    def _target_sync(self, key: tuple, model: str, state: tuple | None) -> SamplerTarget:
        """Get or create a sampler backend (safe from any thread: dict ops only)."""
        with self._targets_lock:
            target = self._targets.get(key)
            if target is not None:
                self._targets.move_to_end(key)
                return target
            target = self._new_target(key, model, state)
            evict = list(self._targets)[: max(0, len(self._targets) - self.config.max_sampler_backends)]
        for old_key in evict:
            self._evict_target(old_key)
        return target

    def _new_target(self, key: tuple, model: str, state: tuple | None) -> SamplerTarget:

        def load():
            if state is None:
                return self._backend(model, None)
            directory, lora = state
            backend = self._backend(model, lora)
            backend.load_state(directory, optimizer=False)
            return backend

        target = SamplerTarget(key, Worker(f"sampler-{uuid.uuid4().hex[:8]}", self.config.max_sample_batch), load)
        self._targets[key] = target
        return target

    def _evict_target(self, key: tuple) -> None:
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

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        workers = [m.worker for m in self.models.values()] + [t.worker for t in self._targets.values()]
        for w in workers:
            w.close(wait=False)
        for w in workers:
            w.close(wait=True, timeout=60)
        for m in self.models.values():
            if m.backend is not None:
                try:
                    m.backend.close()
                except Exception:  # pragma: no cover
                    logger.exception("closing %s", m.model_id)
        for t in self._targets.values():
            if t.backend is not None:
                t.backend.close()
        self.store.close()
