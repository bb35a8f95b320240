"""skyrl-sdk-fsdp: the ``fsdp`` execution engine (PyTorch FSDP2 over ``torch.distributed``).

Installing this package registers engine ``fsdp`` through the ``skyrl_sdk`` entry point::

    Backend(model=..., engine="fsdp", engine_config={"world_size": 2})

The controller (the process that created the Backend) drives N SPMD ranks that
each hold 1/N of the parameters, gradients and optimizer state. See docs/engines.md.

Importing this module is cheap: torch.distributed is imported when an engine is built.
"""

from __future__ import annotations

from typing import Any

import skyrl_sdk
from skyrl_sdk import Register

__version__ = "0.1.0"

__all__ = ["FSDPEngine", "worker_main", "__version__"]


def _factory(**kwargs: Any) -> Any:
    from .engine import FSDPEngine

    return FSDPEngine(**kwargs)


def worker_main() -> None:
    """Under a launcher (torchrun): serve rank 0 on ranks != 0, then exit; return on rank 0.

    Call it at the top of a script started with ``torchrun``; see :mod:`skyrl_sdk_fsdp.entrypoint`.
    """
    from .entrypoint import worker_main as _worker_main

    _worker_main()


def __getattr__(name: str) -> Any:
    if name == "FSDPEngine":
        from .engine import FSDPEngine

        return FSDPEngine
    raise AttributeError(name)


@skyrl_sdk.hookimpl
def skyrl_sdk_register_engines(register: Register) -> None:
    register(
        "fsdp",
        _factory,
        description="PyTorch FSDP2 over N ranks (spawned, or from torchrun); gloo on CPU, NCCL on CUDA.",
    )
