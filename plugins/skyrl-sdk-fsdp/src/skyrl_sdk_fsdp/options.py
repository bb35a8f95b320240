"""The ``engine_config`` keys the fsdp engine adds to the shared :class:`EngineConfig`, and the
environment the controller and the launcher pass to rank processes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, overload

import attrs

from skyrl_sdk.errors import InputError
from skyrl_sdk.types.numbers import check_number

#: Environment variables the controller passes to spawned ranks.
ENV_PREFIX = "SKYRL_FSDP_"

#: Engine-specific keys (passed to ``EngineConfig.from_mapping(extra_keys=...)``).
FSDP_KEYS = (
    "launcher",
    "timeout_s",
    "call_timeout_s",
    "state_format",
    "reshard_after_forward",
    "threads_per_rank",
    "cpu_offload",
    "ray_address",
    "placement_strategy",
)

LAUNCHERS = ("auto", "spawn", "torchrun", "ray")
#: Ray placement strategies of the ranks' placement group (launcher "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
STATE_FORMATS = ("full", "sharded")
#: The torch.distributed.checkpoint folder of ``state_format="sharded"``.
SHARDED_DIR = "sharded"


@overload
def _number(name: str, value: Any, *, allow_none: Literal[False] = False) -> float: ...
@overload
def _number(name: str, value: Any, *, allow_none: bool) -> float | None: ...
def _number(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A positive finite number of seconds (the SDK's one number rule)."""
    if value is None and allow_none:
        return None
    return check_number(f"engine_config[{name!r}] (seconds)", value, low=0.0, low_open=True)


@attrs.frozen
class FSDPOptions:
    """FSDP-only options (see docs/engines.md).

    - ``launcher``: ``"auto"`` (torchrun when its environment variables are set, else spawn),
      ``"spawn"`` (this process starts ``world_size`` worker processes) or ``"torchrun"``.
    - ``timeout_s``: how long a rank waits for its peers in one collective (and for the
      rendezvous) before failing; default 1800.
    - ``call_timeout_s``: optional wall-clock bound on one engine call, seen from the
      controller (spawn launcher); default none (dead or failing ranks are detected anyway).
    - ``state_format``: what ``save_state`` writes: ``"full"`` (default; the local engine's
      files, portable between engines and world sizes) or ``"sharded"``
      (``torch.distributed.checkpoint``: every rank writes its shard; fsdp only). Its
      ``.metadata`` is a pickle: it is read through an allow-list, but load sharded states
      only from your own storage (the server loads only checkpoints it saved itself).
    - ``reshard_after_forward``: FSDP2's option for the transformer blocks (default True:
      least memory; False keeps gathered blocks from forward to backward).
    - ``threads_per_rank``: torch / OpenMP threads per CPU rank (default: cores / world_size).
    - ``cpu_offload``: FSDP2's ``CPUOffloadPolicy``: each rank keeps its parameter, gradient and
      AdamW shards in (pinned) host memory, copies a unit's shards to the GPU for its all-gather and
      steps the optimizer on the CPU. The GPU then holds only the gathered units and activations:
      what lets a 7B full fine-tune fit one 80 GB GPU (docs/engines.md), at the cost of host-device
      copies every step and a CPU optimizer step. Default off.
    - ``ray_address``: the Ray cluster the ranks go to (launcher ``"ray"``; default
      ``RAY_ADDRESS``, else a local cluster this process starts).
    - ``placement_strategy``: the ranks' Ray placement group strategy (default ``"PACK"``).
    """

    launcher: str = "auto"
    timeout_s: float = 1800.0
    call_timeout_s: float | None = None
    state_format: str = "full"
    reshard_after_forward: bool = True
    threads_per_rank: int | None = None
    cpu_offload: bool = False
    ray_address: str | None = None
    placement_strategy: str = "PACK"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> FSDPOptions:
        launcher = extra.get("launcher", "auto")
        if launcher not in LAUNCHERS:
            raise InputError(f"engine_config['launcher']: expected one of {list(LAUNCHERS)}, got {launcher!r}")
        state_format = extra.get("state_format", "full")
        if state_format not in STATE_FORMATS:
            raise InputError(
                f"engine_config['state_format']: expected one of {list(STATE_FORMATS)}, got {state_format!r}"
            )
        reshard = extra.get("reshard_after_forward", True)
        if not isinstance(reshard, bool):
            raise InputError(f"engine_config['reshard_after_forward']: expected a bool, got {reshard!r}")
        offload = extra.get("cpu_offload", False)
        if not isinstance(offload, bool):
            raise InputError(f"engine_config['cpu_offload']: expected true or false, got {offload!r}")
        threads = extra.get("threads_per_rank")
        if threads is not None:
            check_number("engine_config['threads_per_rank']", threads, low=1, integer=True)
        ray_address = extra.get("ray_address")
        if ray_address is not None and not (isinstance(ray_address, str) and ray_address):
            raise InputError(f"engine_config['ray_address']: expected 'host:port' of a Ray cluster, "
                             f"got {ray_address!r}")
        strategy = extra.get("placement_strategy", "PACK")
        if strategy not in PLACEMENT_STRATEGIES:
            raise InputError(f"engine_config['placement_strategy']: expected one of {list(PLACEMENT_STRATEGIES)}, "
                             f"got {strategy!r}")
        for key in ("ray_address", "placement_strategy"):
            if key in extra and launcher != "ray":
                raise InputError(f"engine_config[{key!r}] places the ranks with Ray: it needs launcher 'ray', "
                                 f"not {launcher!r}")
        return cls(
            launcher=launcher,
            ray_address=ray_address,
            placement_strategy=strategy,
            timeout_s=_number("timeout_s", extra.get("timeout_s", 1800.0)),
            call_timeout_s=_number("call_timeout_s", extra.get("call_timeout_s"), allow_none=True),
            state_format=state_format,
            reshard_after_forward=reshard,
            threads_per_rank=threads,
            cpu_offload=offload,
        )

    def threads(self, world_size: int) -> int:
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, (os.cpu_count() or 1) // max(1, world_size))


@attrs.frozen
class LauncherEnv:
    """Rank layout given by a launcher such as torchrun."""

    rank: int
    world_size: int
    local_rank: int


def launcher_env() -> LauncherEnv | None:
    """The torchrun-style environment of this process, or None when not under a launcher."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        return LauncherEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
    except ValueError:
        return None
