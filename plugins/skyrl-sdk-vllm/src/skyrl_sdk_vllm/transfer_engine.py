"""The ``gloo`` weight-transfer backend, vLLM's side: a ``WeightTransferEngine`` registered with
vLLM's ``WeightTransferEngineFactory`` (the wire is :mod:`.transfer`).

It is registered in every process vLLM runs a worker in: through the ``vllm.general_plugins``
entry point (vLLM loads it in each of its processes) and when this plugin imports vLLM. An
engine started with ``weight_transfer_config={"backend": "gloo"}`` then takes weights through
``init_weight_transfer_engine`` (join the group), ``start_weight_update`` (vLLM's layer-wise
reload: each layer's kernel format is rebuilt in its own storage once all its weights arrived),
``update_weights`` (receive and load, bucket by bucket) and ``finish_weight_update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from skyrl_sdk.plugins.weight_push import PushLayout

from . import transfer

BACKEND = "gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the group's store is, and this engine's place in it (its workers follow the
    ``trainer_ranks`` trainer ranks)."""

    host: str
    port: int
    prefix: str
    trainer_ranks: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One push: its layout (``PushLayout.to_plain()``) and the bucket size both sides cut by."""

    layout: dict[str, Any] = field(default_factory=dict)
    bucket_bytes: int = transfer.DEFAULT_BUCKET_BYTES


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """See the module docstring."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:  # vLLM's objects
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.trainer_ranks = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        rank = init_info.trainer_ranks + int(self.parallel_config.rank)
        self.trainer_ranks = init_info.trainer_ranks
        self.group = transfer.open_group(init_info.host, init_info.port, init_info.prefix, rank,
                                         init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        layout = PushLayout.from_plain(update_info.layout)
        if layout.ranks != self.trainer_ranks:
            raise RuntimeError(f"gloo weight transfer: a push from {layout.ranks} trainer ranks into a group "
                               f"of {self.trainer_ranks}")
        for pairs in transfer.receive(self.group, layout, self.trainer_ranks, update_info.bucket_bytes):
            self.model.load_weights(pairs)

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Register the backend with vLLM's factory (idempotent): the ``vllm.general_plugins`` entry point."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, GlooWeightTransferEngine.__name__)
    except ValueError:  # registered already in this process
        pass
