"""The ``fsdp`` engine's controller: the object the Backend drives.

It holds no model. Each call is split across the ranks (datums balanced by token count),
sent to every rank, and the answers are put back together: per-datum outputs in the
caller's order, metrics merged by their reduction suffix. Input was validated by the
Backend; checkpoint files are checked here, before anything is dispatched.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from skyrl_sdk.checkpoint import WEIGHTS_FILE
from skyrl_sdk.engines.base import EngineInfo, EngineResult
from skyrl_sdk.engines.config import EngineConfig
from skyrl_sdk.engines.local import OPTIMIZER_FILE
from skyrl_sdk.errors import CheckpointError, InputError
from skyrl_sdk.losses.resolve import ResolvedLoss
from skyrl_sdk.metrics import MetricAccumulator
from skyrl_sdk.models import load_tokenizer
from skyrl_sdk.types import AdamParams, Datum, LoraConfig, SampleOutput, SamplingParams

from .options import FSDP_KEYS, FSDPOptions, launcher_env
from .split import split_by_tokens

logger = logging.getLogger(__name__)


def _default_world_size(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


class FSDPEngine:
    """PyTorch FSDP2 over ``world_size`` ranks, driven from this process (see docs/engines.md)."""

    name = "fsdp"

    def __init__(
        self, *, model: str, role: str, lora: LoraConfig | None, seed: int, engine_config: dict | None
    ) -> None:
        raw = dict(engine_config or {})
        self.config = EngineConfig.from_mapping(raw, extra_keys=FSDP_KEYS)
        self.options = FSDPOptions.from_extra(self.config.extra)
        device = self.config.torch_device()
        if device.index is not None:
            raise InputError(
                f"engine_config['device']: the fsdp engine places rank r on cuda:r (local rank); "
                f"pass 'cuda' or 'cpu', not {self.config.device!r}"
            )
        self.device_type = device.type
        self.role = role
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
        self._state_shapes: dict[str, list[int]] = first["state_shapes"]
        self._trainable_shapes: dict[str, list[int]] = first["trainable_shapes"]
        self.info = EngineInfo(**first["engine_info"])
        tok_dir = self.info.tokenizer_dir
        self.tokenizer = load_tokenizer(tok_dir) if tok_dir else None
        logger.info("fsdp engine: %d ranks (%s, %s launcher)", self.world_size, self.device_type, launcher)

    def _start_transport(self, env):
        if self.launcher == "torchrun":
            from .transport import CollectiveTransport
            from .worker import _TORCHRUN, torchrun_session, worker_main

            if env.rank != 0:
                # Same script on every rank: ranks != 0 serve rank 0 from here, then exit.
                worker_main()
            session, executor = torchrun_session(self.options.timeout_s)
            engine_id = _TORCHRUN["next_engine_id"]
            _TORCHRUN["next_engine_id"] += 1
            return CollectiveTransport(session, executor, engine_id)
        from .transport import SpawnTransport

        return SpawnTransport(
            world_size=self.world_size, device_type=self.device_type, timeout_s=self.options.timeout_s,
            threads=self.options.threads(self.world_size) if self.device_type == "cpu" else 1,
            call_timeout_s=self.options.call_timeout_s,
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the spawned ranks (empty under torchrun)."""
        return self._transport.pids

    def _all(self, op: str, **payload) -> list:
        return self._transport.request(op, [payload] * self.world_size)

    # ---- compute ----------------------------------------------------------------------
    def run(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool) -> EngineResult:
        lengths = [d.model_input.length for d in data]
        parts = split_by_tokens(lengths, self.world_size)
        spec_config = attrs.asdict(loss.config, recurse=False) if loss.config is not None else None
        loss_payload = dict(name=loss.spec.name, config=spec_config, requested_name=loss.requested_name,
                            dialect=loss.dialect, terms=attrs.asdict(loss.terms))
        payloads = []
        for part in parts:
            items = [
                (data[i].model_input.to_numpy(), {k: v.array for k, v in data[i].loss_fn_inputs.items()})
                for i in part
            ]
            payloads.append(dict(items=items, loss=loss_payload, backward=backward))
        replies = self._transport.request("run", payloads)
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(data)
        acc = MetricAccumulator()
        for part, (rank_outputs, metric_state) in zip(parts, replies):
            for index, out in zip(part, rank_outputs):
                outputs[index] = out
            acc.merge([metric_state])
        return EngineResult(outputs=outputs, metric_state=acc.state())  # type: ignore[arg-type]

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        return self._all("optim_step", params=attrs.asdict(params), grad_scale=float(grad_scale))[0]

    def zero_grad(self) -> None:
        self._all("zero_grad")

    # ---- state ------------------------------------------------------------------------
    def save_state(self, directory: Path) -> dict[str, Any]:
        return self._all("save_state", directory=str(directory), state_format=self.options.state_format)[0]

    def _check_full_state(self, directory: Path, optimizer: bool) -> dict[str, float]:
        """Check the files against this model before dispatch; return {param: step} of the optimizer."""
        from safetensors import safe_open

        weights_file = directory / WEIGHTS_FILE
        if not weights_file.is_file():
            raise CheckpointError(f"missing checkpoint file {weights_file}")
        try:
            with safe_open(str(weights_file), "pt") as f:
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as exc:
            raise CheckpointError(f"{weights_file} is not a readable safetensors file: {exc}") from None
        missing = [k for k in self._state_shapes if k not in shapes]
        unexpected = [k for k in shapes if k not in self._state_shapes]
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint weights do not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        wrong = [f"{k}: {shapes[k]} != {v}" for k, v in self._state_shapes.items() if shapes[k] != v]
        if wrong:
            raise CheckpointError(f"checkpoint weights do not fit this model: shape mismatch {wrong[:5]}")
        if not optimizer:
            return {}
        optim_file = directory / OPTIMIZER_FILE
        if not optim_file.is_file():
            raise CheckpointError(f"missing checkpoint file {optim_file}")
        steps: dict[str, float] = {}
        try:
            with safe_open(str(optim_file), "pt") as f:
                keys = set(f.keys())
                for name, shape in self._trainable_shapes.items():
                    if f"{name}::exp_avg" not in keys:
                        continue
                    for kind in ("exp_avg", "exp_avg_sq"):
                        got = list(f.get_slice(f"{name}::{kind}").get_shape())
                        if got != shape:
                            raise CheckpointError(f"{optim_file}: {name}::{kind} has shape {got}, expected {shape}")
                    steps[name] = float(f.get_tensor(f"{name}::step").reshape(-1)[0])
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{optim_file} is not a usable optimizer state: {exc!r}") from None
        return steps

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        directory = Path(directory)
        state_format = metadata.get("state_format", "full")
        if state_format == "sharded":
            if not (directory / "sharded").is_dir():
                raise CheckpointError(f"{directory}: missing the sharded checkpoint folder 'sharded'")
            steps: dict[str, float] = {}
        elif state_format == "full":
            steps = self._check_full_state(directory, optimizer)
        else:
            raise CheckpointError(f"{directory}: unknown state_format {state_format!r}")
        self._all("load_state", directory=str(directory), optimizer=bool(optimizer),
                  step=int(metadata.get("step", 0)), state_format=state_format, optimizer_steps=steps)

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        self._all("export_weights", directory=str(directory), merge_lora=bool(merge_lora))

    # ---- sampling ---------------------------------------------------------------------
    def sample(
        self, prompts: Sequence[np.ndarray], params: SamplingParams, num_samples: int, prompt_logprobs: bool
    ) -> list[SampleOutput]:
        if self.role != "policy":
            raise InputError("sampling needs a policy model; this Backend's role is 'critic'")
        return self._all(
            "sample", prompts=[np.asarray(p, dtype=np.int64) for p in prompts], params=attrs.asdict(params),
            num_samples=int(num_samples), prompt_logprobs=bool(prompt_logprobs),
        )[0]

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
