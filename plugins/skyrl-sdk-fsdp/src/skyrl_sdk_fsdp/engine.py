"""The ``fsdp`` engine's controller: the object the Backend drives.

It holds no model. Each call is split across the ranks (datums balanced by token count, the
datums of a shared-prefix group kept on one rank),
sent to every rank, and the answers are put back together: per-datum outputs in the
caller's order, metrics merged by their reduction suffix. Input was validated by the
Backend; checkpoint files are checked here, before anything is dispatched.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from skyrl_sdk.engines import Engine, EngineConfig, EngineInfo, EngineResult, ResolvedLoss, image_inputs
from skyrl_sdk.engines.plain import datums_to_plain, loss_to_plain
from skyrl_sdk.engines.state import StateLayout, check_engine_metadata, check_state_files
from skyrl_sdk.engines.throughput import cuda_name, peak_flops
from skyrl_sdk.errors import CheckpointError, InputError
from skyrl_sdk.losses.metrics import MetricAccumulator
from skyrl_sdk.models import load_tokenizer
from skyrl_sdk.models.attention import check_available
from skyrl_sdk.models.prefix import find_groups
from skyrl_sdk.types import AdamParams, Datum, LoraConfig, SampleOutput

from .options import FSDP_KEYS, SHARDED_DIR, FSDPOptions, LauncherEnv, launcher_env
from .sampling import FSDPWeights
from .split import split_by_tokens

if TYPE_CHECKING:
    from .ray_transport import RayTransport
    from .transport import CollectiveTransport, SpawnTransport

logger = logging.getLogger(__name__)


def _default_world_size(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


class FSDPEngine(Engine):
    """PyTorch FSDP2 over ``world_size`` ranks, driven from this process (see docs/engines.md)."""

    name = "fsdp"

    def __init__(
        self, *, model: str, role: str, lora: LoraConfig | None, seed: int, engine_config: dict | None
    ) -> None:
        raw = dict(engine_config or {})
        self.config = EngineConfig.from_mapping(raw, extra_keys=FSDP_KEYS)
        self.options = FSDPOptions.from_extra(self.config.extra)
        if self.options.launcher == "ray":  # the ranks' devices are the cluster's, not this process's
            from .ray_transport import ray_device_type

            self.device_type = ray_device_type(self.config.device, self.options.ray_address)
            raw["device"] = self.device_type
        else:
            device = self.config.torch_device()
            if device.index is not None:
                raise InputError(
                    f"engine_config['device']: the fsdp engine places rank r on cuda:r (local rank); "
                    f"pass 'cuda' or 'cpu', not {self.config.device!r}"
                )
            self.device_type = device.type
        check_available(self.config.attn_implementation, self.device_type)  # before any rank starts
        if self.config.offload_while_sampling:
            raise InputError("engine_config['offload_while_sampling']: the fsdp engine's ranks keep the trainer in "
                             "their own processes; keep their shards in host memory with engine_config['cpu_offload']")
        self.role = role
        self.lora = lora
        env = launcher_env()
        launcher = self.options.launcher
        if launcher == "auto":
            launcher = "torchrun" if env is not None else "spawn"
        self.launcher = launcher
        if launcher == "torchrun":
            if env is None:
                raise InputError(
                    "engine_config['launcher']='torchrun' but this process was not started by torchrun "
                    "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set)"
                )
            if "world_size" in raw and raw["world_size"] != env.world_size:
                raise InputError(
                    f"engine_config['world_size']={raw['world_size']} but torchrun started {env.world_size} ranks"
                )
            self.world_size = env.world_size
        elif launcher == "ray":
            from .ray_transport import ray_world_size

            self.world_size = raw["world_size"] if "world_size" in raw else ray_world_size(self.device_type)
        else:
            self.world_size = raw["world_size"] if "world_size" in raw else _default_world_size(self.device_type)
            if self.device_type == "cuda":
                import torch

                if self.world_size > torch.cuda.device_count():
                    raise InputError(
                        f"engine_config['world_size']={self.world_size} but only {torch.cuda.device_count()} "
                        f"CUDA devices are visible (one rank per device)"
                    )
        init = dict(
            model=str(model), role=role, lora=attrs.asdict(lora) if lora is not None else None, seed=int(seed),
            engine_config=raw,
        )
        self._transport = self._start_transport(env)
        self._finalizer = weakref.finalize(self, self._transport.close)
        try:
            infos = self._transport.request("init", [init] * self.world_size)
        except BaseException:
            self.close()
            raise
        first = infos[0]
        #: the tensors (names, shapes, dtypes) a saved state must hold to load: checked before the ranks read it
        self.state_layout = StateLayout.from_plain(first["state_layout"])
        self.info = EngineInfo(**first["engine_info"])
        #: how the ranks got their weights: "files" (each read its own slices) or "rank0" (scattered)
        self.weights_loaded_from = first["weights_loaded_from"]
        tok_dir = self.info.tokenizer_dir
        self.tokenizer = load_tokenizer(tok_dir) if tok_dir else None
        #: a vision-language model's image processor: the Backend reads images through it here,
        #: and the ranks get the prepared pixels
        self.images = image_inputs(str(model), self.config)
        logger.info("fsdp engine: %d ranks (%s, %s launcher)", self.world_size, self.device_type, launcher)

    def _start_transport(self, env: LauncherEnv | None) -> SpawnTransport | CollectiveTransport | RayTransport:
        if self.launcher == "torchrun":
            from .dispatch import TorchrunJob
            from .entrypoint import worker_main
            from .transport import CollectiveTransport

            assert env is not None  # __init__ refused the torchrun launcher without its environment
            if env.rank != 0:
                # Same script on every rank: ranks != 0 serve rank 0 from here, then exit.
                worker_main()
            job = TorchrunJob.get(self.options.timeout_s)
            return CollectiveTransport(job, job.new_engine_id())
        threads = self.options.threads(self.world_size) if self.device_type == "cpu" else 1
        if self.launcher == "ray":
            from .ray_transport import RayTransport

            return RayTransport(world_size=self.world_size, device_type=self.device_type,
                                timeout_s=self.options.timeout_s, threads=threads,
                                ray_address=self.options.ray_address, strategy=self.options.placement_strategy,
                                call_timeout_s=self.options.call_timeout_s)
        from .transport import SpawnTransport

        return SpawnTransport(
            world_size=self.world_size, device_type=self.device_type, timeout_s=self.options.timeout_s,
            threads=self.options.threads(self.world_size) if self.device_type == "cpu" else 1,
            call_timeout_s=self.options.call_timeout_s,
        )

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the spawned ranks (empty under torchrun)."""
        return self._transport.pids

    def _all(self, op: str, **payload: Any) -> list:
        return self._transport.request(op, [payload] * self.world_size)

    # ---- compute ----------------------------------------------------------------------
    def run(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool) -> EngineResult:
        lengths = [d.model_input.length for d in data]
        together = []
        if self.info.prefix_sharing.startswith("on"):  # a group stays on one rank, to share its prefix there
            groups, _ = find_groups([d.model_input.to_numpy() for d in data], self.config.prefix_sharing_min_tokens,
                                    self.config.micro_batch_tokens)
            together = [(g.members, g.unique_tokens) for g in groups]
        parts = split_by_tokens(lengths, self.world_size, together)
        loss_payload = loss_to_plain(loss)
        payloads = [
            dict(items=datums_to_plain([data[i] for i in part]), loss=loss_payload, backward=backward)
            for part in parts
        ]
        replies = self._transport.request("run", payloads)
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(data)
        acc = MetricAccumulator()
        for part, (rank_outputs, metric_state, _) in zip(parts, replies, strict=True):
            for index, out in zip(part, rank_outputs, strict=True):
                outputs[index] = out
            acc.merge([metric_state])
        status = replies[0][2]  # the same on every rank (their self-test's verdict is agreed on)
        if status != self.info.prefix_sharing:  # the ranks' self-test ran at the first call
            self.info = attrs.evolve(self.info, prefix_sharing=status)
        return EngineResult(outputs=outputs, metric_state=acc.state())  # type: ignore[arg-type]

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        return self._all("optim_step", params=attrs.asdict(params), grad_scale=float(grad_scale))[0]

    def zero_grad(self) -> None:
        self._all("zero_grad")

    # ---- state ------------------------------------------------------------------------
    def save_state(self, directory: Path) -> dict[str, Any]:
        return self._all("save_state", directory=str(directory), state_format=self.options.state_format)[0]

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        # Every file is checked here, before anything is dispatched: a bad checkpoint changes nothing.
        directory = Path(directory)
        step, _ = check_engine_metadata(metadata, str(directory))
        state_format = metadata.get("state_format", "full")
        if state_format == "sharded":
            from .sharded_state import check_sharded

            check_sharded(directory / SHARDED_DIR, self.state_layout, optimizer)  # every value too
            steps: dict[str, float] = {}
        elif state_format == "full":
            steps = check_state_files(directory, self.state_layout, optimizer=optimizer).steps
        else:
            raise CheckpointError(f"{directory}: unknown state_format {state_format!r}")
        self._all("load_state", directory=str(directory), optimizer=bool(optimizer),
                  step=step, state_format=state_format, optimizer_steps=steps)

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        self._all("export_weights", directory=str(directory), merge_lora=bool(merge_lora))

    def peak_flops(self) -> float | None:
        """All ranks' devices at their peak (one GPU per rank, rank 0's kind)."""
        c = self.config
        return peak_flops(self.device_type, cuda_name(self.device_type, 0), c.dtype, c.peak_tflops,
                          devices=self.world_size)

    # ---- sampling ---------------------------------------------------------------------
    def weights_source(self) -> FSDPWeights:
        return FSDPWeights(self)

    def dispatch_sample(self, request: dict[str, Any]) -> list[SampleOutput]:
        """(``RankZeroDecoder``) Our decode loop on rank 0's copy of the weights at this engine's
        weights version (gathered again when it moved); ``request`` as ``sample_request_to_plain``."""
        return self._all("sample", request=request, weights_version=self.weights_version)[0]

    # ---- introspection ----------------------------------------------------------------
    def gradients(self) -> dict[str, np.ndarray]:
        """Pending full gradients by parameter name (gathered to rank 0): tests and debugging."""
        return self._all("gradients")[0]

    def memory(self) -> list[dict[str, int]]:
        """Per rank: bytes of its parameter, gradient and optimizer-state shards."""
        return self._all("memory")

    def debug_fail(self, rank: int, mode: str = "raise") -> None:
        """Tests: make ``rank`` raise (or exit) while the other ranks wait in a collective."""
        self._all("debug_fail", rank=int(rank), mode=mode)

    def close(self) -> None:
        self._finalizer()
