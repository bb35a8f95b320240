"""Where the ``vllm`` sampler's engines run and how their weights get there: the ``sampler_config``
keys of placement and transfer (README: Placement), split off before the engine's own keys.

- ``placement="local"`` (the default): one engine on this machine. A trainer in this process
  (the ``local`` engine) hands it its live tensors; any other (``fsdp``: the weights live in the
  ranks) pushes them through vLLM's weight-transfer API.
- ``placement="ray"``: ``engines`` engines as Ray actors, each ``tensor_parallel_size``-way
  tensor parallel, on devices of their own, or on the trainer's (``colocate``: the fsdp engine's
  Ray ranks' GPUs, with sleep / wake); every one gets every push.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from skyrl_sdk.errors import InputError
from skyrl_sdk.types.numbers import Validator, check_number

PLACEMENTS = ("local", "ray")
#: ``auto``: NCCL between GPUs of different processes, gloo otherwise (CPUs, or a colocated GPU)
TRANSFERS = ("auto", "gloo", "nccl")
KEYS = ("placement", "engines", "tensor_parallel_size", "colocate", "transfer", "ray_address",
        "transfer_timeout_s", "bucket_mib", "cpus_per_engine", "overlap")


def _choice(options: tuple[str, ...]) -> Validator:
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in options:
            raise InputError(f"sampler_config[{attribute.name!r}]: expected one of {list(options)}, got {value!r}")
    return validate


def _count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_number(f"sampler_config[{attribute.name!r}]", value, low=1, integer=True)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_number(f"sampler_config[{attribute.name!r}]", value, low=0.0, low_open=True)


@attrs.frozen
class PlacementConfig:
    """See the module docstring; README: Placement."""

    placement: str = attrs.field(default="local", validator=_choice(PLACEMENTS))
    engines: int = attrs.field(default=1, validator=_count)
    tensor_parallel_size: int = attrs.field(default=1, validator=_count)
    colocate: bool = False
    transfer: str = attrs.field(default="auto", validator=_choice(TRANSFERS))
    ray_address: str | None = None
    #: how long a transfer waits for its peer in one send or receive before failing
    transfer_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    #: the push's bucket: one message per trainer rank and engine worker per bucket
    bucket_mib: float = attrs.field(default=64.0, validator=_positive)
    #: CPUs reserved for each engine actor (Ray)
    cpus_per_engine: float = attrs.field(default=1.0, validator=_positive)
    #: disaggregated engines sample while the trainer trains (a sample waits only for a weights
    #: sync); false: every sample waits for the training call in progress, as on one device
    overlap: bool = True

    def __attrs_post_init__(self) -> None:
        for key in ("colocate", "overlap"):
            if not isinstance(getattr(self, key), bool):
                raise InputError(f"sampler_config[{key!r}]: expected true or false, got {getattr(self, key)!r}")
        if self.ray_address is not None and not (isinstance(self.ray_address, str) and self.ray_address):
            raise InputError(f"sampler_config['ray_address']: expected 'host:port' of a Ray cluster, got "
                             f"{self.ray_address!r}")
        if self.placement == "local":
            for key, default in (("engines", 1), ("tensor_parallel_size", 1), ("colocate", False),
                                 ("ray_address", None)):
                if getattr(self, key) != default:
                    raise InputError(f"sampler_config[{key!r}] needs placement 'ray' (placement 'local' runs one "
                                     f"engine in this process or beside it)")
        if self.colocate and self.tensor_parallel_size != 1:
            raise InputError("sampler_config['colocate']: colocated engines run one per trainer GPU "
                             "(tensor_parallel_size 1)")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mib * 2**20)

    @classmethod
    def split(cls, config: Mapping[str, Any]) -> tuple[PlacementConfig, dict[str, Any]]:
        """(the placement keys, typed; the engine's own keys, as given)."""
        mine = {k: v for k, v in config.items() if k in KEYS}
        return cls(**mine), {k: v for k, v in config.items() if k not in KEYS}
