"""The live server state: sessions, training models (one Backend + queue each) and the jobs
that run Tinker's requests on them, in ``seq_id`` order. Routes and the console call only this
class and the services it holds for them: ``sessions`` (client sessions, :mod:`.sessions`),
``catalog`` (runs, checkpoints, curves, :mod:`.catalog`) and ``weights`` (the requests that
write weights to the state dir, :mod:`.weights`).

Route handlers (event loop) call into :class:`Runtime`; every Backend call happens on the
compute executor (:mod:`.executor`) through the owning model's queue, in fair turns. Every
request carries its API key's owner: another owner's ids read as unknown, and an owner's
unfinished requests are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import attrs

from ...engines.turns import Steps
from ...errors import InputError, NotFoundError, quoted
from ...inputs import tinker_proto
from ...inputs.coerce import lora_config_from_any
from ...losses.stability import sequence_ids
from ...types import SampleOutput
from ..config import ServerConfig
from ..state.history import History
from ..state.statedir import StateDirLock
from ..state.store import Store
from ..wire import envelopes, proto
from ..wire.bodies import Bodies
from ..wire.tinker_paths import TinkerPath
from . import visibility
from .catalog import Catalog
from .executor import RUNNING_AT_SHUTDOWN, SHUTDOWN_MESSAGE, Executors
from .exports import DownloadLinks
from .futures import FutureRecord, FutureStore, Job, Result, Sequencer
from .recorded import RecordedSequences
from .sampling import Sampling
from .served import ServedModels
from .sessions import Sessions, TrainingModel
from .weights import WeightRequests

logger = logging.getLogger(__name__)


class _ShuttingDown(Exception):
    """A request that arrived after the shutdown began."""


class Runtime:
    def __init__(self, config: ServerConfig, loop: asyncio.AbstractEventLoop, bodies: Bodies | None = None,
                 state_lock: StateDirLock | None = None) -> None:
        self.config = config
        self.loop = loop
        self.bodies = bodies or Bodies.of(config)
        self.store = Store(config.state_dir, state_lock)
        self.history = History(self.store.root / "server.sqlite3")  # the console's curves
        self.futures = FutureStore(loop, redact=self.redact, max_failed_bytes=config.max_failed_bytes)
        self.served = ServedModels(config, offload_root=self.store.scratch_dir("offload"))
        # the local engine computes in this process: one executor for every model (docs/server.md)
        self.executors = Executors(shared=config.engine == "local", turn_tokens=config.turn_tokens)
        self.sampling = Sampling(config, self.store, self.served, self.executors)
        self.sessions = Sessions(config, self.store, loop, self._end_session, self._session_busy)
        self.models: dict[str, TrainingModel] = {}
        self.catalog = Catalog(self.store, self.history, self.models, self.sampling.runs_sampled,
                               self.sessions.silent_for)
        #: the sequences sampled with record_stability_info (stable_reinforce), per session and owner
        self.recorded = RecordedSequences(config.max_recorded_bytes)
        # signed links to external weights' files, checked against the catalog when used
        self.downloads = DownloadLinks(self.catalog.link_record,
                                       lambda path: self.store.checkpoint_dir(TinkerPath.parse(path)))
        #: save_weights, save_weights_for_sampler, save_weights_external and the expiry sweep
        self.weights = WeightRequests(self.store, self.sampling, self.sequenced, loop)
        self.started_at = time.time()
        #: monotonic time of the first shutdown signal (None while serving)
        self.stopping: float | None = None
        #: whether close() left a running job to the process exit
        self.left_running = False
        self.store.tidy()

    def redact(self, message: str) -> str:
        """``message`` with server paths shown as ``tinker://`` paths (or ``<state-dir>``; no disk read)."""
        return self.store.redact(message)

    # ---- future routes: one entry, so an unreadable body is one failed future ------------------
    async def submit(self, owner: str, route: str, raw: bytes, content_type: str = "") -> dict[str, Any]:
        """Accept a request for a future route. Bad input still gets a future, failed with a
        user error (the client raises it at once instead of retrying a bare 400). The owner's
        queue bound is checked before the body is parsed; a large body is parsed off the loop."""
        handlers: dict[str, Callable[[str, dict], FutureRecord | Awaitable[FutureRecord]]] = {
            "create_model": self.create_model, "load_weights": self.load_weights, "optim_step": self.optim_step,
            "save_weights": self.weights.save_weights,
            "save_weights_for_sampler": self.weights.save_weights_for_sampler,
            "save_weights_external": self.weights.save_weights_external, "asample": self.sample,
        }
        try:
            self._admit(owner)
            if route == "forward_backward":
                if "json" in content_type:
                    raise InputError("forward_backward: send a protobuf ForwardBackwardRequest "
                                     "(Content-Type: application/x-protobuf)")
                req = await self.bodies.parse(raw, tinker_proto.forward_backward_from_proto, raw, self._seq_limit,
                                              self.config.max_tokens_per_request)
                rec = self.forward_backward(owner, req)
            else:
                handled = handlers[route](owner, await self.bodies.parse(raw, envelopes.json_request, raw, route))
                rec = await handled if isinstance(handled, Awaitable) else handled  # one reading the state dir
        except InputError as exc:
            rec = self.futures.failed(owner, exc, prefix="sample" if route == "asample" else "req")
        except _ShuttingDown:
            rec = self.futures.create(owner, None, prefix="sample" if route == "asample" else "req")
            self.futures.finish(rec, Result.error(SHUTDOWN_MESSAGE, "server"))
        out = envelopes.future_json(rec.request_id, rec.model_id)
        if route == "asample":
            out["sample_sequence_ids"] = sequence_ids(rec.request_id, rec.extra.get("num_samples", 0))
        return out

    def _admit(self, owner: str) -> None:
        """Refuse a request up front when its owner already has ``max_queued_requests`` unfinished."""
        if self.stopping is not None:
            raise _ShuttingDown
        pending, limit = self.futures.pending(owner), self.config.max_queued_requests
        if pending >= limit:
            raise InputError(f"too many requests in flight: {pending} of yours are queued or running, and this "
                             f"server accepts at most {limit} per owner (--max-queued-requests); wait for some "
                             f"to finish, then submit again")

    async def retrieve(self, owner: str, body: dict, ended: asyncio.Event | None = None) -> Result | dict:
        """Long-poll a future: its Result, or a ``try_again`` (at once once ``ended`` is set) / unknown-id answer."""
        request_id = body.get("request_id")
        rec, result = await self.futures.wait(owner, request_id, self.config.long_poll_s, ended) \
            if isinstance(request_id, str) else (None, None)
        if rec is None:
            return {"error": f"unknown request_id {quoted(request_id)}: this server has no such request (requests in "
                             f"flight are lost when the server restarts)", "category": "server"}
        if rec.model_id is not None and (model := self.models.get(rec.model_id)) is not None:
            self.sessions.seen(model.session_id)
        if result is None:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        return result

    # ---- models --------------------------------------------------------------------------------
    def model(self, owner: str, model_id: Any) -> TrainingModel:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or m.owner != owner:
            raise NotFoundError(f"unknown model_id {quoted(model_id)}: this server has no such model (models live in "
                                f"memory and are lost when the server restarts; recreate it with "
                                f"create_training_client_from_state)")
        return m

    def _live_model(self, owner: str, model_id: Any) -> TrainingModel:
        model = self.model(owner, model_id)
        if model.closed:
            raise InputError(f"model {model.model_id} was released: {model.closed}")
        self.sessions.seen(model.session_id)
        return model

    def _session_busy(self, session_id: str) -> bool:
        """Whether a model of the session has work queued or running."""
        return any(m.session_id == session_id and not m.closed and m.worker.idle_for() == 0.0
                   for m in self.models.values())

    def _end_session(self, session_id: str, why: str) -> None:
        """(a session finished or expired) Release its models and drop its recorded sequences
        (a sample of it still running records nothing)."""
        self.recorded.end(session_id)
        for model in list(self.models.values()):
            if model.session_id == session_id and not model.closed:
                self._release(model, why)

    def _release(self, model: TrainingModel, why: str) -> None:
        """Free a model's memory once its queued work is done."""
        model.closed = why

        def close() -> Result:
            if model.backend is not None:
                model.backend.close()
                model.backend = None
            self.sampling.drop_snapshots(model)
            self.served.log_loaded()
            return Result.json({})

        model.sequencer.fail_pending(f"model {model.model_id} was released: {why}")
        model.worker.put(Job(run=close, done=lambda r: model.worker.close(wait=False), what="release"))

    async def create_model(self, owner: str, body: dict) -> FutureRecord:
        req = envelopes.parse_new_model(body)

        def plan() -> tuple:  # (base, lora, user metadata, directory): what _create's plan returns
            return self.served.resolve(req.base_model), lora_config_from_any(req.lora_config), req.user_metadata, None

        return await self._create(owner, req, plan, {"model_id": req.model_id, "type": "create_model"})

    async def load_weights(self, owner: str, body: dict) -> FutureRecord:
        """Create-from-state (session_id + model_seq_id) or a load into an existing model."""
        if body.get("session_id") is not None:
            req = envelopes.parse_new_model(body, from_state=True)

            def plan() -> tuple:
                tp, directory = self.store.resolve_checkpoint(req.path, owner, kind="training", readable=True)
                if (run := self.store.run(tp.run_id, None)) is None:  # the caller's, or another owner's published
                    raise InputError(f"checkpoint {tp} cannot be loaded: its training run is gone")
                base = self.served.resolve(req.base_model or run["base_model"])
                return base, lora_config_from_any(run["lora"]), req.user_metadata or run["user_metadata"], directory

            answer = {"model_id": req.model_id, "path": req.path, "type": "load_weights"}
            return await self._create(owner, req, plan, answer)

        def make(model: TrainingModel) -> Callable[[], Result]:
            req = envelopes.parse_load(body)

            def load() -> Result:
                _, directory = self.store.resolve_checkpoint(req.path, owner, kind="training", readable=True)
                backend = model.require_backend()
                self.sampling.before_weight_change(model)
                backend.load_state(directory, optimizer=req.optimizer)
                return Result.json({"path": req.path, "model_id": model.model_id, "type": "load_weights"})

            return load

        return self.sequenced(owner, body, "load_weights", make, cost=None)

    async def _create(self, owner: str, req: envelopes.NewModel, plan: Callable[[], tuple], answer: dict
                      ) -> FutureRecord:
        """Create a model (fresh, or from a checkpoint directory). Everything is checked (``plan``
        on a thread) before anything is registered: a rejected request leaves no model, worker or record."""
        await self.sessions.open(owner, req.session_id)
        dedup = (owner, "create_model", req.model_id)
        if (old := self.futures.lookup(dedup)) is not None:
            return old
        base, lora, metadata, directory = await asyncio.to_thread(plan)
        if (old := self.futures.lookup(dedup)) is not None:  # a retry that came in meanwhile: nothing awaits from here
            return old
        if (existing := self.models.get(req.model_id)) is not None and not existing.closed:
            raise InputError(f"model {req.model_id} already exists")
        worker = self.executors.queue(req.model_id, owner, self.config.max_sample_batch,
                                      self.config.sample_batch_wait_s)
        sequencer = Sequencer(worker, 1, self.config.gap_timeout_s, self.config.boundary_grace_s)
        model = TrainingModel(req.model_id, owner, req.session_id, base, lora, worker, sequencer, asyncio.Event())
        self.models[req.model_id] = model
        rec = self.futures.create(owner, req.model_id, dedup)
        complete = self.futures.completer(rec)
        records = self.recorded.of(owner, req.session_id)

        def create() -> Result:
            try:
                self.store.add_run(req.model_id, owner, req.session_id, base, attrs.asdict(lora) if lora else None,
                                   metadata)
                backend = self.served.open_backend(base, lora, label=req.model_id)
                if directory is not None:
                    try:
                        backend.load_state(directory, optimizer=req.optimizer)
                    except BaseException:
                        backend.close()
                        raise
                backend.sequences = records  # provenance's session records
                model.backend = backend
            except BaseException as exc:
                model.error = str(exc)
                raise
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the server has shut down
                    self.loop.call_soon_threadsafe(model.ready.set)
            return Result.json(answer)

        def done(result: Result) -> None:
            complete(result)
            if model.backend is None:  # creation failed: nothing will run on this worker
                worker.close(wait=False)

        worker.put(Job(run=create, done=done, what=f"create_model({req.model_id})"))
        return rec

    async def get_info(self, owner: str, body: dict) -> dict:
        model = self.model(owner, body.get("model_id"))
        await asyncio.wait_for(model.ready.wait(), timeout=3600)
        # the client names its samplers' base model by model_name, and loads their tokenizer by it
        return envelopes.model_info_json(model.model_id, self.served.client_name(model.base_model),
                                    model.require_backend().get_info())

    # ---- training requests (sequenced per model) -----------------------------------------------
    def sequenced(self, owner: str, body: dict | None, what: str, make_run: Callable[[TrainingModel], Callable],
                  model_id: Any = None, seq: Any = None, cost: int | None = 0) -> FutureRecord:
        """Queue ``make_run(model)`` in the model's ``seq_id`` order. The model must be the
        caller's; a retry of a (model, seq_id) gets the first submission's future. Bad input
        found by ``make_run`` fails the future but still takes its turn, so later requests
        do not wait for a seq_id that will never come."""
        if body is not None:
            model_id, seq = envelopes.model_id(body), envelopes.seq_id(body)
        model = self._live_model(owner, model_id)
        dedup = (owner, "model", model.model_id, "seq_id", seq) if seq is not None else None
        if (old := self.futures.lookup(dedup)) is not None:
            logger.info("%s: (model %s, seq_id %s) was already submitted; returning %s", what, model.model_id, seq,
                        old.request_id)
            return old
        try:
            run = make_run(model)
        except InputError as exc:
            def run(exc: InputError = exc) -> NoReturn:
                raise exc
        rec = self.futures.create(owner, model.model_id, dedup)
        self.loop.run_in_executor(None, self.store.touch_run, model.model_id)  # never raises
        # a boundary: the client submitted every earlier seq_id before this one (see Sequencer)
        boundary = what not in ("forward", "forward_backward") or not self.config.parallel_chunks
        model.sequencer.submit(seq, Job(run=run, done=self.futures.completer(rec), what=f"{what}({model.model_id})",
                                        cost=cost), boundary=boundary)
        return rec

    def _seq_limit(self, model_id: str) -> int | None:
        """(any thread) The longest datum ``model_id``'s base accepts."""
        return self.served.max_seq_len(model.base_model if (model := self.models.get(model_id)) else None)

    def forward_backward(self, owner: str, req: tinker_proto.ForwardBackwardRequest) -> FutureRecord:
        def make(model: TrainingModel) -> Callable[[], Steps[Result]]:
            if req.error is not None or (data := req.data) is None:  # data is None only with an error
                raise InputError(req.error or "forward_backward: no data")

            def run() -> Steps[Result]:  # a stepped call: the executor may run others' jobs between its steps
                backend = model.require_backend()
                call = backend.forward_steps if req.forward_only else backend.forward_backward_steps
                started = time.time()
                out = yield from call(data, loss_fn=req.loss_fn, loss_fn_config=req.loss_fn_config)
                if not req.forward_only:
                    self.history.forward_backward(model.model_id, out.metrics, started, data, req.loss_fn)
                return Result.proto(proto.forward_backward_output_to_proto(out))

            return run

        what = "forward" if req.forward_only else "forward_backward"
        cost = None if any(d.model_input.has_images for d in req.data or ()) else req.tokens  # images: never in a gap
        return self.sequenced(owner, None, what, make, model_id=req.model_id, seq=req.seq_id, cost=cost)

    def optim_step(self, owner: str, body: dict) -> FutureRecord:
        def make(model: TrainingModel) -> Callable[[], Result]:
            params = envelopes.parse_adam_params(body)

            def run() -> Result:
                backend = model.require_backend()
                self.sampling.before_weight_change(model)
                out = backend.optim_step(params)
                self.history.optim_step(model.model_id, out.metrics)
                return Result.json(envelopes.optim_step_json(out.metrics))

            return run

        return self.sequenced(owner, body, "optim_step", make)

    # ---- sampling ------------------------------------------------------------------------------
    async def create_sampling_session(self, owner: str, body: dict) -> str:
        session_id = envelopes.session_id(body)
        seq = envelopes.integer(body, "sampling_session_seq_id")
        source = envelopes.parse_sampler_source(body)
        await self.sessions.open(owner, session_id)
        sid = f"{session_id}:sample:{seq}"
        await self.sampling.create(owner, session_id, sid, source.model_path, source.base_model)
        return sid

    async def get_sampler(self, owner: str, sampler_id: str) -> dict:
        s = await self.sampling.session(owner, sampler_id)
        # the client loads a sampler's tokenizer by this name: give one that resolves offline
        return {"sampler_id": s.sid, "base_model": self.served.client_name(s.base_model), "model_path": s.model_path}

    async def sample(self, owner: str, body: dict) -> FutureRecord:
        spec = envelopes.parse_sample_request(body, self.config.max_num_samples)
        sid, seq = envelopes.parse_sample_ref(body)
        if sid is not None:
            session = await self.sampling.session(owner, sid)
        else:
            source = envelopes.parse_sampler_source(body)
            session = await asyncio.to_thread(self.sampling.session_from, owner, source.model_path,
                                              source.base_model, "adhoc")
        dedup = (owner, "sampling session", sid, "seq_id", seq) if sid is not None and seq is not None else None
        if (old := self.futures.lookup(dedup)) is not None:
            return old
        rec = self.futures.create(owner, None, dedup, prefix="sample")
        try:
            record = None
            if spec.request.record_stability_info:
                if session.session_id is None:
                    raise InputError("record_stability_info: recorded sequences belong to a session; sample "
                                     "through a sampling client (a sampling_session_id), not an ad-hoc request")
                try:  # an ended session's sequences were dropped with it: none are recorded for it again
                    await self.sessions.check_open(owner, session.session_id)
                except InputError as exc:
                    raise InputError(f"record_stability_info: {exc}") from None
                records, prompt = self.recorded.of(owner, session.session_id), spec.request.prompt_token_ids()[0]

                def record(out: SampleOutput) -> None:
                    records.record_outputs([prompt], [out], [rec.request_id])
            await self.sampling.submit(session, spec, self.futures.completer(rec), record)
        except InputError as exc:
            self.futures.finish(rec, Result.from_exception(exc))
        rec.extra["num_samples"] = spec.request.num_samples
        return rec

    # ---- visibility ----------------------------------------------------------------------------
    def loaded(self, owner: str) -> dict[str, Any]:
        """What is loaded (bases, adapters, bytes, offloaded adapters, own copies), as ``owner``
        may see it (:mod:`.visibility`)."""
        doc = visibility.loaded(self.served.loaded(with_backends=True), owner, self.config.is_operator(owner),
                                self.models, self.sampling.targets(), self.redact)
        return {**doc, "snapshots": self.sampling.snapshots.stats()}

    # ---- shutdown ------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """(event loop, at the first Ctrl-C / SIGTERM, before connections drain) Fail every request
        that has not run, answering its long-polls with "the server is shutting down"; the
        running job stops at its next micro-batch (:meth:`settle` waits for it)."""
        if self.stopping is not None:
            return
        self.stopping = time.monotonic()
        self.weights.stop()
        for m in self.models.values():
            m.sequencer.fail_pending(SHUTDOWN_MESSAGE)
        self.executors.stop()

    async def settle(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """(event loop, after :meth:`begin_shutdown`) Wait for the running job until ``shutdown_s``
        after the signal (or ``give_up()``: a second signal), so its long-poll answers with what
        happened (a committed save is done); what is still unanswered then ran past the deadline."""
        await self.executors.settle((self.stopping or time.monotonic()) + self.config.shutdown_s, give_up)
        self.futures.fail_unfinished(RUNNING_AT_SHUTDOWN)

    def close(self) -> None:
        """(any thread, after ``begin_shutdown`` and ``sessions.stop()``) Wait for the running job until
        ``shutdown_s`` after the signal, then close every Backend; a job still running then (a long
        save) is left to the process exit (``left_running``): closing Backends under it is unsafe."""
        deadline = (self.stopping or time.monotonic()) + self.config.shutdown_s
        self.executors.stop()
        if not self.executors.join(deadline):
            logger.warning("a job was still running %.0f s after the shutdown began; leaving it to the exit",
                           self.config.shutdown_s)
            self.left_running = True
            self.store.close()
            return
        for m in self.models.values():
            if m.backend is not None:
                try:
                    m.backend.close()
                except Exception:  # pragma: no cover
                    logger.exception("closing %s", m.model_id)
        self.sampling.close()
        self.served.close()
        self.history.close()
        self.store.close()
