"""The ``vllm`` sampler when its engines do not share the trainer's tensors: engines that get the
weights pushed (:mod:`.fleet`), in this process, beside it, or as Ray actors (:mod:`.placement`).

``sampler="vllm"`` builds this class when ``placement="ray"``, or when the source's weights are
not this process's tensors (the ``fsdp`` engine: its ranks hold them); otherwise the in-process
:class:`~.sampler.VllmSampler` reads the trainer's live tensors itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from skyrl_sdk.errors import InputError
from skyrl_sdk.sampling import Sampler, SampleRequest, WeightsSource
from skyrl_sdk.types import SampleOutput

from . import requests
from .config import VllmSamplerConfig
from .fleet import Fleet
from .placement import PlacementConfig
from .replica import facts_of

logger = logging.getLogger(__name__)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


class PushedVllmSampler(Sampler):
    """See the module docstring; README: Placement."""

    name = "vllm"

    def __init__(self, *, source: WeightsSource, config: Mapping[str, Any], placement: PlacementConfig,
                 engine_config: Mapping[str, Any]) -> None:
        super().__init__(source=source, config=config)
        self.placement = placement
        self.options = VllmSamplerConfig.from_mapping(engine_config)  # every key checked before anything starts
        if self.options.sleep_level == 2:
            raise InputError("sampler_config['sleep_level']=2 drops the weights after each sample call; engines that "
                             "get them pushed use level 1 (or 0)")
        self.engine_config = dict(engine_config)
        self.wire_dtype = self.options.dtype or source.dtype
        self.facts = facts_of(source)
        self._waited: tuple[Any, float] | None = None  # (the fleet's sync record, the seconds a sample waited)
        self._engines_placement: Any = None
        host = self._connect()
        self.gpu = _on_gpu_cluster() if placement.placement == "ray" else _on_gpu()
        self.backend = self._transport()
        if placement.placement == "ray":
            from .ray_engines import EnginePlacement

            self._engines_placement = EnginePlacement(placement, self.gpu)
            args = {**dict(self.engine_config.get("engine_args") or {}), **self._engines_placement.engine_args()}
            self.engine_config["engine_args"] = args
        self.fleet = Fleet(source, placement, self._start, self.backend, self.wire_dtype, host)
        #: engines on devices of their own sample while the trainer trains (Backend.sample)
        self.runs_apart = placement.placement == "ray" and not placement.colocate and placement.overlap
        try:
            self.fleet.sync()  # start the engines, push the weights: a bad setting fails here
        except BaseException:
            self.close()
            raise

    def _transport(self) -> str:
        t = self.placement.transfer
        # engines on GPUs of their own take NCCL; one beside the controller ("local") shares a GPU
        # with a trainer process (rank 0 or the local engine), which NCCL cannot join twice
        own_gpus = self.gpu and self.placement.placement == "ray" and not self.placement.colocate
        if t == "auto":
            return "nccl" if own_gpus else "gloo"
        if t == "nccl" and not own_gpus:
            raise InputError("sampler_config['transfer']='nccl' needs the engines on GPUs of their own "
                             "(NCCL cannot join two processes on one GPU); use 'gloo'")
        return t

    def _connect(self) -> str:
        """Where the transfer groups' stores are hosted: this process's address as the engines see it."""
        if self.placement.placement != "ray":
            return "127.0.0.1"
        from skyrl_sdk_ray.cluster import connect, node_ip

        logger.info("vllm sampler: %s", connect(self.placement.ray_address))
        return node_ip()

    def _start(self, index: int) -> Any:
        from . import handles

        if self._engines_placement is not None:
            return handles.RayActor(index, self.facts, self.engine_config, self.backend,
                                    self._engines_placement.options(index))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # torchrun: vLLM must not see this job's group
            return handles.ChildProcess(index, self.facts, self.engine_config, self.backend)
        return handles.InProcess(index, self.facts, self.engine_config, self.backend)

    def describe(self) -> str:
        return self.fleet.describe()

    def weights_current(self) -> bool:
        return self.fleet.current()

    def sync_weights(self) -> None:
        t0 = time.perf_counter()
        before = self.fleet.last_sync
        self.fleet.sync()
        if self.fleet.last_sync is not before and self.fleet.last_sync is not None:
            self._waited = (self.fleet.last_sync, time.perf_counter() - t0)

    def sample(self, request: SampleRequest) -> list[SampleOutput]:
        """The engines' samples; their weights synced first unless the sampler runs apart (then the
        Backend syncs them, holding its lock, before it calls this)."""
        self.refuse(request, requests.SERVED)
        if not self.runs_apart:
            t0 = time.perf_counter()
            self.sync_weights()
            if self._waited is not None and self._waited[0] is self.fleet.last_sync:
                self._waited = (self._waited[0], time.perf_counter() - t0)
        return self.fleet.sample(request)

    @property
    def last_sync(self) -> dict[str, Any] | None:
        """The last weights sync: ``kind`` ("full", "base" or "lora"), ``seconds`` (when a sample
        call did it: the whole time that call waited for the weights, gathering, sending and
        loading included), ``bytes`` (to all engines), ``version``, ``engines``, ``transfer``."""
        fleet = getattr(self, "fleet", None)
        record = fleet.last_sync if fleet is not None else None
        if record is not None and self._waited is not None and self._waited[0] is record:
            return {**record, "seconds": self._waited[1]}
        return record

    def before_training(self) -> None:
        """The trainer computes next: colocated engines give the GPU back (sleep), once per turn."""
        if self.options.sleep_level:
            self.fleet.before_training()

    def close(self) -> None:
        fleet = getattr(self, "fleet", None)
        if fleet is not None:
            fleet.close()
        placement, self._engines_placement = self._engines_placement, None
        if placement is not None:
            placement.remove()
        from skyrl_sdk.plugins.weight_push import drop_sender

        if fleet is not None:
            drop_sender(f"skyrl-vllm-fleet-{fleet.id}")


def _on_gpu_cluster() -> bool:
    from skyrl_sdk_ray.cluster import cluster_resources

    return cluster_resources().get("GPU", 0) >= 1
