"""Controller <-> ranks when Ray places the ranks (``launcher="ray"``).

The controller joins the cluster (``engine_config["ray_address"]``, else ``RAY_ADDRESS``, else a
local cluster it starts: :func:`skyrl_sdk_ray.cluster.connect`), reserves one bundle per rank in
a placement group (``{"GPU": 1, "CPU": c}`` on CUDA, ``{"CPU": c}`` on CPU; ``PACK``: as few nodes
as fit), and starts one :class:`~.ray_rank.RankActor` per bundle. They rendezvous through a TCP
store the controller hosts on its node's address. A request is one actor call per rank; a rank
whose actor died (its process killed, its node lost) fails the call with ``EngineError`` naming
it, within about a second, and the other ranks (possibly stuck in a collective with it) are
stopped: the same contract as the spawn launcher (:mod:`.transport`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .transport import GRACE_S, _Transport

logger = logging.getLogger(__name__)

#: how long to wait for the placement group (a cluster without room is refused by name after it)
PLACEMENT_TIMEOUT_S = 300.0
#: a GPU rank's share of its bundle's device in Ray's books: the rest is a colocated engine's
COLOCATED_GPU_SHARE = 0.5


class RayTransport(_Transport):
    """Ranks as Ray actors (see the module docstring)."""

    def __init__(self, *, world_size: int, device_type: str, timeout_s: float, threads: int,
                 ray_address: str | None, strategy: str = "PACK", call_timeout_s: float | None = None) -> None:
        import ray
        import torch.distributed as dist
        from skyrl_sdk_ray.cluster import connect, node_ip
        from skyrl_sdk_ray.placement import Placement, share_with_engines

        from .ray_rank import RankActor

        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        self.broken: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.actors: list[Any] = []
        self.placement = None
        self.cluster = connect(ray_address)
        host = node_ip()
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        bundle = {"GPU": 1.0, "CPU": float(threads)} if device_type == "cuda" else {"CPU": float(threads)}
        try:
            self.placement = Placement([bundle] * world_size, strategy=strategy, timeout_s=PLACEMENT_TIMEOUT_S,
                                       what="fsdp ranks")
            remote = ray.remote(RankActor)
            for rank in range(world_size):
                # on a GPU the rank takes half of its bundle's device in Ray's books (all of it in fact):
                # the other half is where a colocated vLLM engine goes (skyrl_sdk_vllm.ray_engines)
                options = self.placement.options(rank, env={"OMP_NUM_THREADS": str(threads)},
                                                 **({"num_gpus": COLOCATED_GPU_SHARE} if device_type == "cuda" else {}))
                self.actors.append(remote.options(name=None, max_concurrency=1, **options).remote(
                    rank=rank, world_size=world_size, store_host=host, store_port=self._store.port,
                    device_type=device_type, timeout_s=timeout_s, threads=threads))
            self.where = ray.get([a.where.remote() for a in self.actors], timeout=PLACEMENT_TIMEOUT_S)
            if device_type == "cuda":
                share_with_engines(self.placement)
        except BaseException:
            self.close()
            raise
        logger.info("fsdp ranks on %s: %s", self.cluster, [(w["node_ip"], w["pid"]) for w in self.where])

    @property
    def pids(self) -> list[int]:
        return [w["pid"] for w in getattr(self, "where", [])]

    def _exchange(self, op: str, payloads: Sequence[Any]) -> tuple[dict[int, Any], dict[int, str], bool]:
        import ray
        from ray.exceptions import RayActorError

        refs = {self.actors[r].handle.remote(0, op, payloads[r]): r for r in range(self.world_size)}
        replies: dict[int, Any] = {}
        deaths: dict[int, str] = {}
        start = time.monotonic()
        first_failure: float | None = None
        timed_out = False
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.2)
            for ref in ready:
                rank = refs.pop(ref)
                try:
                    replies[rank] = ray.get(ref)
                except RayActorError as exc:
                    deaths[rank] = f"died (its Ray actor: {_first_line(exc)})"
                if rank in deaths or (replies[rank][0] == "error" and not replies[rank][1]["clean"]):
                    first_failure = first_failure or time.monotonic()
            now = time.monotonic()
            if first_failure is not None and now - first_failure > GRACE_S:
                break
            if self.call_timeout_s is not None and now - start > self.call_timeout_s:
                timed_out = True
                break
        return replies, deaths, timed_out

    def _fail(self, reason: str) -> None:
        self.broken = reason
        logger.debug("fsdp engine failed (%s); stopping its ranks", reason)
        self._stop()

    def _stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # gone already
                pass
        self.actors = []
        if self.placement is not None:
            from skyrl_sdk_ray.placement import share_with_engines, trainer_placement

            if trainer_placement() is self.placement:
                share_with_engines(None)
            self.placement.remove()
            self.placement = None

    def close(self) -> None:
        """Stop the rank actors and free their placement group; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop()
        self._store = None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "died" in line.lower() or "killed" in line.lower()),
                lines[0] if lines else type(exc).__name__)[:300]


def ray_device_type(device: str, ray_address: str | None) -> str:
    """The ranks' device kind: ``"auto"`` is CUDA when the cluster has GPUs (the controller may
    have none), else CPU; ``"cuda"`` / ``"cpu"`` as given (a device index is refused)."""
    from skyrl_sdk_ray.cluster import cluster_resources, connect

    from skyrl_sdk.errors import InputError

    if device not in ("auto", "cuda", "cpu"):
        raise InputError(f"engine_config['device']: the fsdp engine's Ray ranks take one GPU each; pass 'auto', "
                         f"'cuda' or 'cpu', not {device!r}")
    connect(ray_address)
    gpus = cluster_resources().get("GPU", 0)
    if device == "cuda" and gpus < 1:
        raise InputError("engine_config['device']='cuda' but the Ray cluster has no GPU")
    return device if device != "auto" else ("cuda" if gpus >= 1 else "cpu")


def ray_world_size(device_type: str) -> int:
    """The default number of ranks under Ray: one per GPU of the cluster, or 2 on CPU."""
    from skyrl_sdk_ray.cluster import cluster_resources

    return max(1, int(cluster_resources().get("GPU", 0))) if device_type == "cuda" else 2
