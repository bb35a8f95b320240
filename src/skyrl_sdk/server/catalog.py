"""What an owner may list and manage outside a model: training runs and their checkpoints
(the RestClient and tinker-cookbook's resume and rolling saves use these)."""

from __future__ import annotations

from typing import Any

from ..errors import UnknownError
from . import wire
from .store import Store, TinkerPath


class Catalog:
    def __init__(self, store: Store) -> None:
        self.store = store

    def _run(self, owner: str, run_id: Any) -> dict:
        run = self.store.run(run_id, owner) if isinstance(run_id, str) else None
        if run is None:
            raise UnknownError(f"unknown training run {run_id!r}")
        return run

    def run(self, owner: str, run_id: str) -> dict:
        run = self._run(owner, run_id)
        return wire.run_json(run, self.store.last_checkpoint(run["run_id"], "training"),
                             self.store.last_checkpoint(run["run_id"], "sampler"))

    def runs(self, owner: str, limit: int, offset: int) -> dict:
        runs, total = self.store.list_runs(owner, max(0, limit), max(0, offset))
        return {"training_runs": [self.run(owner, r["run_id"]) for r in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def checkpoints(self, owner: str, run_id: str | None, limit: int = 10**9, offset: int = 0) -> dict:
        if run_id is not None:
            self._run(owner, run_id)
            return {"checkpoints": self.store.list_checkpoints(owner, run_id)[0], "cursor": None}
        checkpoints, total = self.store.list_checkpoints(owner, None, max(0, limit), max(0, offset))
        return {"checkpoints": checkpoints, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def delete_checkpoint(self, owner: str, run_id: str, checkpoint_id: str) -> None:
        tp = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}")
        if self.store.run(tp.run_id, owner) is None or not self.store.delete_checkpoint(tp):
            raise UnknownError(f"no checkpoint {tp} on this server")

    def weights_info(self, owner: str, body: dict) -> dict:
        tp, _ = self.store.resolve_checkpoint(body.get("tinker_path"), owner)
        return wire.weights_info_json(self._run(owner, tp.run_id))
