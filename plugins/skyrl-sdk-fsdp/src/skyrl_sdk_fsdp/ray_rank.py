"""What one rank runs as a Ray actor (``launcher="ray"``): the entry point of a rank process that
Ray started, placed and owns.

The actor joins the ranks' process group through the controller's TCP store, then serves
``handle(engine id, op, payload)`` calls with the same dispatcher as a spawned rank: answers are
``("ok", result)`` or ``("error", details)``. Ray ends the actor when the controller (its owner)
goes away, and fails the controller's pending calls when the actor dies
(:mod:`.ray_transport` names the rank).
"""

from __future__ import annotations

import os
import signal
from typing import Any


class RankActor:
    """One fsdp rank in a Ray actor (see the module docstring)."""

    def __init__(self, *, rank: int, world_size: int, store_host: str, store_port: int, device_type: str,
                 timeout_s: float, threads: int) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the controller
        torch.set_num_threads(threads)
        try:  # no per-rank progress bars in the driver's log
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # pragma: no cover
            pass
        from .dispatch import Dispatcher, describe_error
        from .session import init_session

        self.rank = rank
        self.failure: dict | None = None
        try:
            store = dist.TCPStore(store_host, store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            session = init_session(rank=rank, world_size=world_size, local_rank=0, device_type=device_type,
                                   timeout_s=timeout_s, store=store)
            self.dispatcher = Dispatcher(session)
        except Exception as exc:  # answered at the first call (the controller sees a clean failure)
            self.failure = describe_error(exc, rank, clean=True)

    def handle(self, engine_id: int, op: str, payload: Any) -> tuple[str, Any]:
        if self.failure is not None:
            return "error", self.failure
        return self.dispatcher.handle(engine_id, op, payload)

    def where(self) -> dict[str, Any]:
        """This rank's process and node (tests, logs)."""
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}
