"""Where Ray puts the ``vllm`` sampler's engines (``placement="ray"``).

- **Disaggregated** (the default): a placement group of its own, one bundle per engine
  (``{"GPU": 1, "CPU": c}``, or ``{"CPU": c}`` on a CPU cluster). An engine that is
  ``tensor_parallel_size``-way parallel gets a group of that many GPU bundles: its actor on the
  first (no GPU of its own), vLLM's Ray executor placing its workers on all of them.
- **Colocated** (``colocate: true``): engine ``i`` on bundle ``i`` of the fsdp engine's Ray ranks
  (``skyrl_sdk_ray.placement.trainer_placement``), taking the half of the GPU the rank leaves
  (``COLOCATED_GPU_SHARE``); vLLM's ``gpu_memory_utilization`` and sleep levels decide memory.
"""

from __future__ import annotations

from typing import Any

from skyrl_sdk.errors import InputError

from .placement import PlacementConfig

#: the share of a trainer bundle's GPU a colocated engine (and the fsdp rank beside it) takes
COLOCATED_GPU_SHARE = 0.5


class EnginePlacement:
    """The placement groups of one sampler's engines (see the module docstring)."""

    def __init__(self, config: PlacementConfig, gpu: bool) -> None:
        from skyrl_sdk_ray.placement import Placement, trainer_placement

        self.config, self.gpu = config, gpu
        self.groups: list[Any] = []
        self.shared = None
        if config.colocate:
            self.shared = trainer_placement()
            if self.shared is None or not gpu:
                raise InputError("sampler_config['colocate']: colocated engines share the GPUs of an fsdp engine "
                                 "with engine_config['launcher']='ray' on GPUs; there is none in this process")
            if config.engines > len(self.shared.bundles):
                raise InputError(f"sampler_config['engines']={config.engines}: the fsdp engine has "
                                 f"{len(self.shared.bundles)} GPUs to colocate with")
            return
        t, cpus = config.tensor_parallel_size, config.cpus_per_engine
        if t == 1:
            bundle = {"GPU": 1.0, "CPU": cpus} if gpu else {"CPU": cpus}
            self.groups = [Placement([bundle] * config.engines, strategy="PACK", what="vllm engines")]
        else:
            if not gpu:
                raise InputError("sampler_config['tensor_parallel_size'] > 1 needs GPUs in the Ray cluster")
            self.groups = [Placement([{"GPU": 1.0, "CPU": cpus}] * t, strategy="PACK", what=f"vllm engine {i}'s GPUs")
                           for i in range(config.engines)]

    def options(self, index: int) -> dict[str, Any]:
        """``Replica`` actor options of engine ``index``."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if self.shared is not None:
            return self.shared.options(index, env=env, num_cpus=0, num_gpus=COLOCATED_GPU_SHARE)
        if self.config.tensor_parallel_size == 1:
            return self.groups[0].options(index, env=env)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = self.groups[index].options(0, env=env, num_gpus=0)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=self.groups[index].group, placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True)  # vLLM's Ray workers go into this engine's group
        return options

    def engine_args(self) -> dict[str, Any]:
        """What vLLM needs to know of this placement."""
        if self.config.tensor_parallel_size == 1:
            return {}
        return {"tensor_parallel_size": self.config.tensor_parallel_size, "distributed_executor_backend": "ray"}

    def remove(self) -> None:
        for group in self.groups:
            group.remove()
        self.groups = []
