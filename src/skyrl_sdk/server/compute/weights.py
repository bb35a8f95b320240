"""The requests that write a model's weights to the state dir: checkpoints
(``save_weights``), sampler weights (``save_weights_for_sampler``, named or ephemeral) and
exports (``save_weights_external``, :mod:`.exports`), each in the model's ``seq_id`` order; and
the sweep that deletes checkpoints whose time to live ran out.

A mixin of :class:`~.runtime.Runtime` (it uses the runtime's store, sampling sessions,
sequencing and event loop), kept apart so each module stays one job's size.
"""

from __future__ import annotations

import uuid

from ..wire import envelopes
from ..wire.tinker_paths import TinkerPath
from .exports import age_recipients, export_external
from .futures import FutureRecord, Result
from .sessions import TrainingModel

#: how often expired checkpoints are deleted (an expired one is gone from every answer at once)
EXPIRY_SWEEP_S = 60.0


class WeightRequests:
    """save_weights, save_weights_for_sampler, save_weights_external and the expiry sweep."""

    def save_weights(self, owner: str, body: dict) -> FutureRecord:
        def make(model: TrainingModel):
            save = envelopes.parse_save(body)
            tp = TinkerPath(model.model_id, "training", save.name)
            self.store.checkpoint_dir(tp)  # a path inside the state dir, checked now

            def run() -> Result:
                self.store.delete_expired()
                backend = model.require_backend()
                self.store.save_recorded(tp, lambda d: backend.save_state(d, overwrite=save.overwrite),
                                         save.ttl_seconds, save.user_metadata)
                return Result.json({"path": str(tp), "type": "save_weights"})

            return run

        return self._sequenced(owner, body, "save_weights", make, cost=None)

    def save_weights_external(self, owner: str, body: dict) -> FutureRecord:
        """Export the weights for download (:mod:`.exports`): an external_weights checkpoint."""
        def make(model: TrainingModel):
            save, raw_recipients = envelopes.parse_external_save(body)
            recipients = age_recipients(raw_recipients)
            tp = TinkerPath(model.model_id, "external", save.name)
            self.store.checkpoint_dir(tp)  # a path inside the state dir, checked now

            def run() -> Result:
                self.store.delete_expired()
                scratch = self.store.scratch_dir("exports", uuid.uuid4().hex)
                backend = model.require_backend()
                self.store.save_recorded(
                    tp, lambda d: export_external(backend, model.lora is not None, d, scratch, recipients),
                    save.ttl_seconds)
                return Result.json({"path": str(tp), "type": "save_weights_external"})

            return run

        return self._sequenced(owner, body, "save_weights_external", make, cost=None)

    def _sweep_expired(self) -> None:
        """(event loop, every EXPIRY_SWEEP_S) Delete expired checkpoints' records and files, off the loop."""
        self._expiry_sweep = self.loop.call_later(EXPIRY_SWEEP_S, self._sweep_expired)
        if self.stopping is None:
            self.loop.run_in_executor(None, self.store.delete_expired)

    def save_weights_for_sampler(self, owner: str, body: dict) -> FutureRecord:
        def make(model: TrainingModel):
            req = envelopes.parse_sampler_save(body)
            if (save := req.save) is not None:
                tp = TinkerPath(model.model_id, "sampler", save.name)
                self.store.checkpoint_dir(tp)  # a path inside the state dir, checked now

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
        return self._sequenced(owner, body, "save_weights_for_sampler", make, cost=None if named else 0)
