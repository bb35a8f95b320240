"""Many LoRA clients on one copy of a base model, in process: :class:`SharedBase`.

>>> with SharedBase(model="tiny") as base:  # doctest: +SKIP
...     alice = base.backend(lora={"rank": 8})
...     bob = base.backend(lora={"rank": 8}, seed=1)
...     alice.forward_backward(data, "cross_entropy"); bob.forward_backward(other, "cross_entropy")

Each :meth:`SharedBase.backend` is an ordinary :class:`~skyrl_sdk.Backend` whose results,
checkpoints and exports equal a solo ``Backend(model, lora=..., seed=...)``'s; the base
weights exist once. The server (``skyrl-sdk serve``) builds its LoRA clients the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .backend import Backend
from .engines.adapter import AdapterEngine, ReadOnlyBaseEngine
from .engines.base import Engine
from .engines.pool import AdapterPool
from .errors import InputError
from .inputs.coerce import lora_config_from_any
from .types import LoraConfig


class _Factory:
    """Builds a Backend's engine on the shared base (Backend accepts an engine factory)."""

    engine_name = "local"  # the local engine's arithmetic; checkpoints are interchangeable with it

    def __init__(self, shared: AdapterPool, label: str, base_only: bool = False) -> None:
        self.shared, self.label, self.base_only = shared, label, base_only

    def __call__(self, *, model: str, role: str, lora: LoraConfig | None, seed: int,
                 engine_config: dict[str, Any]) -> Engine:
        if self.base_only:
            return ReadOnlyBaseEngine(self.shared)
        if lora is None:  # SharedBase.backend refuses it first
            raise InputError("lora: a client of a shared base trains a LoRA adapter")
        return AdapterEngine(self.shared, self.shared.add_adapter(lora, seed, self.label))


class SharedBase:
    """One base model in memory; LoRA Backends on it (see the module docstring).

    ``max_lora_adapters``: adapters whose tensors stay in memory; the least recently used
    beyond it go to ``offload_dir`` (a temporary directory by default) and come back on
    their next call. ``seed`` initialises the base of the built-in ``tiny`` model (a real
    model's weights come from its files) and is each adapter's default seed.
    """

    def __init__(
        self, model: str = "tiny", engine_config: Mapping[str, Any] | None = None, *, role: str = "policy",
        seed: int = 0, dialect: str = "tinker", max_lora_adapters: int | None = None,
        offload_dir: str | Path | None = None,
    ) -> None:
        if role not in ("policy", "critic"):
            raise InputError(f"role must be 'policy' or 'critic', got {role!r}")
        self.model, self.role, self.seed, self.dialect = str(model), role, seed, dialect
        self.shared = AdapterPool(self.model, role=role, seed=seed, engine_config=dict(engine_config or {}),
                                  max_adapters=max_lora_adapters, offload_dir=offload_dir)

    def backend(self, lora: Any, *, seed: int | None = None, dialect: str | None = None,
                grad_accumulation: str = "sum", label: str = "", sampler: str = "transformers",
                sampler_config: Mapping[str, Any] | None = None) -> Backend:
        """A new LoRA client: a :class:`Backend` with its own adapter on the shared base.
        Closing the Backend frees its adapter. A sampler that holds its own copy of the weights
        (``sampler="vllm"``) serves every client of this base from one copy of the base."""
        config = lora_config_from_any(lora)
        if config is None:
            raise InputError("lora: a shared base trains LoRA adapters only; full fine-tuning needs its own "
                             "copy of the weights (a plain Backend without lora)")
        return Backend(model=self.model, engine=_Factory(self.shared, label), lora=config, role=self.role,
                       dialect=dialect or self.dialect, seed=self.seed if seed is None else seed,
                       grad_accumulation=grad_accumulation, sampler=sampler, sampler_config=sampler_config)

    def base_backend(self, *, dialect: str | None = None, sampler: str = "transformers",
                     sampler_config: Mapping[str, Any] | None = None) -> Backend:
        """The base model itself as a read-only Backend (forward, sample, export), sharing the weights."""
        return Backend(model=self.model, engine=_Factory(self.shared, "base", base_only=True), role=self.role,
                       dialect=dialect or self.dialect, seed=self.seed, sampler=sampler,
                       sampler_config=sampler_config)

    def stats(self) -> dict[str, Any]:
        """What is loaded: base bytes, each adapter's bytes (or offloaded), offload counts and times."""
        return self.shared.stats()

    def close(self) -> None:
        self.shared.close()

    def __enter__(self) -> SharedBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
