"""The requests that write a model's weights to the state dir: checkpoints
(``save_weights``), sampler weights (``save_weights_for_sampler``, named or ephemeral) and
exports (``save_weights_external``, :mod:`.exports`), each in the model's ``seq_id`` order; and
the sweep that deletes checkpoints whose time to live ran out.

A service of its own beside :class:`~.catalog.Catalog`: the runtime builds it with what it
uses (the store, the sampling sessions, the runtime's :meth:`~.runtime.Runtime.sequenced`
and the event loop) and routes the three requests to it. Every touch of the state dir runs
in the request's job, on the compute thread; the sweep runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from ..state.store import Store
from ..wire import envelopes
from ..wire.tinker_paths import TinkerPath
from .exports import age_recipients, export_external
from .futures import FutureRecord, Result
from .sampling import Sampling
from .sessions import TrainingModel

#: how often expired checkpoints are deleted (an expired one is gone from every answer at once)
EXPIRY_SWEEP_S = 60.0

#: ``Runtime.sequenced``: queue ``make_run(model)`` in the model's ``seq_id`` order
Sequenced = Callable[..., FutureRecord]


class WeightRequests:
    """save_weights, save_weights_for_sampler, save_weights_external and the expiry sweep."""

    def __init__(self, store: Store, sampling: Sampling, sequenced: Sequenced,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.sampling = sampling
        self.sequenced = sequenced
        self.loop = loop
        self._sweep: asyncio.TimerHandle | None = loop.call_later(EXPIRY_SWEEP_S, self._timer)

    def save_weights(self, owner: str, body: dict) -> FutureRecord:
        def make(model: TrainingModel) -> Callable[[], Result]:
            save = envelopes.parse_save(body)
            tp = TinkerPath(model.model_id, "training", save.name)

            def run() -> Result:
                self.store.delete_expired()
                backend = model.require_backend()
                self.store.save_recorded(tp, lambda d: backend.save_state(d, overwrite=save.overwrite),
                                         save.ttl_seconds, save.user_metadata)
                return Result.json({"path": str(tp), "type": "save_weights"})

            return run

        return self.sequenced(owner, body, "save_weights", make, cost=None)

    def save_weights_external(self, owner: str, body: dict) -> FutureRecord:
        """Export the weights for download (:mod:`.exports`): an external_weights checkpoint."""
        def make(model: TrainingModel) -> Callable[[], Result]:
            save, raw_recipients = envelopes.parse_external_save(body)
            recipients = age_recipients(raw_recipients)
            tp = TinkerPath(model.model_id, "external", save.name)

            def run() -> Result:
                self.store.delete_expired()
                scratch = self.store.scratch_dir("exports", uuid.uuid4().hex)
                backend = model.require_backend()
                self.store.save_recorded(
                    tp, lambda d: export_external(backend, model.lora is not None, d, scratch, recipients),
                    save.ttl_seconds)
                return Result.json({"path": str(tp), "type": "save_weights_external"})

            return run

        return self.sequenced(owner, body, "save_weights_external", make, cost=None)

    def save_weights_for_sampler(self, owner: str, body: dict) -> FutureRecord:
        def make(model: TrainingModel) -> Callable[[], Result]:
            req = envelopes.parse_sampler_save(body)
            if (save := req.save) is not None:
                tp = TinkerPath(model.model_id, "sampler", save.name)

                def run_named() -> Result:
                    backend = model.require_backend()
                    self.store.save_recorded(tp, lambda d: backend.save_weights_for_sampler(d, overwrite=True),
                                             save.ttl_seconds, save.user_metadata)
                    return Result.json({"path": str(tp), "type": "save_weights_for_sampler"})

                return run_named
            sid = f"{model.session_id}:sample:{req.sampling_session_seq_id}"

            def run_ephemeral() -> Result:
                self.sampling.add_ephemeral(model, sid, req.kind)
                return Result.json({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

            return run_ephemeral

        named = body.get("path") is not None  # a named export writes to disk; a snapshot only pins
        return self.sequenced(owner, body, "save_weights_for_sampler", make, cost=None if named else 0)

    # ---- the expiry sweep -------------------------------------------------------------------------
    def _timer(self) -> None:
        self._sweep = self.loop.call_later(EXPIRY_SWEEP_S, self._timer)
        self.sweep_expired()

    def sweep_expired(self) -> None:
        """(event loop; a timer calls it every EXPIRY_SWEEP_S) Delete expired checkpoints' records
        and files, off the loop."""
        self.loop.run_in_executor(None, self.store.delete_expired)

    def stop(self) -> None:
        """(event loop, shutdown) No more sweeps."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
