"""Engines on a :class:`~.shared.AdapterPool`: one client's LoRA adapter, or the base read-only.

:class:`AdapterEngine` is the local engine (it subclasses :class:`~.local.LocalEngine` and
keeps its compute, optimizer and sampling code) with every call run in the adapter's turn on
the shared base. Checkpoints and exports hold exactly what a solo LoRA Backend writes: the
peft adapter name is translated to the solo one, and other clients' adapters are left out.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import CheckpointError, InputError
from ..losses.resolve import ResolvedLoss
from ..models.checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, dedupe_shared, save_tensors
from ..models.loading import LoadedModel, hf_model
from ..types import AdamParams, Datum
from .base import EngineInfo, EngineResult
from .export import export_hf_directory, lora_unties_head, save_peft_adapter
from .local import LocalEngine
from .pool import Adapter, AdapterPool, solo_name
from .state import StateLayout, check_engine_metadata, check_state_files
from .turns import Steps, each_step
from .weights import EngineWeights


def _owner(key: str, names: set[str]) -> str | None:
    """The adapter a state-dict key belongs to (None: the base)."""
    return next((part for part in key.split(".") if part in names), None)


def solo_state(module: torch.nn.Module, adapter: str | None, names: set[str]) -> dict[str, torch.Tensor]:
    """``module``'s state as a solo model with only ``adapter`` (None: no adapter) has it: other
    adapters' tensors left out, the adapter named as a solo one, and layers wrapped only for
    other adapters under their plain names (``q_proj.weight``, not ``q_proj.base_layer.weight``)."""
    from peft.tuners.lora import LoraLayer

    plain = {n for n, m in module.named_modules() if isinstance(m, LoraLayer)
             and (adapter is None or adapter not in m.lora_A)}
    out = {}
    for key, value in module.state_dict().items():
        owner = _owner(key, names)
        if owner is None:
            prefix, sep, leaf = key.rpartition(".base_layer.")
            out[f"{prefix}.{leaf}" if sep and prefix in plain else key] = value
        elif owner == adapter:
            out[solo_name(key, owner)] = value
    return out


def merged_state(module: torch.nn.Module, adapter: str | None, names: set[str]) -> dict[str, torch.Tensor]:
    """The HF model's weights with ``adapter``'s delta merged in (other adapters ignored).

    The same formula as :func:`~.export.merged_lora_state_dict` (peft's
    ``transpose(B @ A, fan_in_fan_out) * scaling``) restricted to one adapter; layers it
    does not target keep their base weight."""
    from peft.tuners.lora import LoraLayer

    inner = hf_model(module)
    state = {k: v for k, v in inner.state_dict().items() if _owner(k, names) in (None, adapter)}
    for name, layer in inner.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        weight = state.pop(f"{name}.base_layer.weight")
        if adapter is not None and adapter in layer.lora_A:
            with torch.no_grad():
                delta = state[f"{name}.lora_B.{adapter}.weight"] @ state[f"{name}.lora_A.{adapter}.weight"]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                weight = weight + (delta * layer.scaling[adapter]).to(weight.dtype)
        state[f"{name}.weight"] = weight
        if f"{name}.base_layer.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return {k: v for k, v in state.items() if "lora_" not in k}


class _OnSharedBase(LocalEngine):
    """What both engines share: the pool, the info, the turn around every call."""

    name = "local"

    def __init__(self, shared: AdapterPool, adapter: Adapter | None) -> None:
        # LocalEngine.__init__ is not called: the model is the pool's, not loaded here.
        self.shared = shared
        self.adapter = adapter
        self.config = shared.config
        self.device = shared.device
        self.tokenizer = shared.loaded.tokenizer
        self.images = shared.images
        extra = adapter.num_parameters if adapter is not None else 0
        self.info = EngineInfo.of(shared.loaded, counts=(shared.base_parameters + extra, extra))

    # LocalEngine assigns ``loaded`` once; here it is derived from the pool on each read
    @property
    def loaded(self) -> LoadedModel:  # type: ignore[override]  # LocalEngine's methods read the model here
        # the transformers model (peft's layers inside it run the active adapter, or none)
        return attrs.evolve(self.shared.loaded, lora=self.adapter.lora if self.adapter is not None else None)

    def _names(self) -> set[str]:
        return set(self.shared.adapters)

    def _key(self) -> str | None:
        return self.adapter.name if self.adapter is not None else None

    def turn(self) -> AbstractContextManager[None]:
        """This adapter's turn on the shared base (the bare base's for the read-only engine)."""
        return self.shared.using(self.adapter)

    def weights_source(self) -> EngineWeights:
        """This adapter (or the bare base) on the shared base: its base key is the pool, so a
        sampler may serve all of the pool's adapters from one copy of the base."""
        return EngineWeights(self, module=self.shared.loaded.module, peft=self.shared.module, adapter=self._key(),
                             base_key=self.shared, turn=self.turn)

    def export_weights(self, directory: Path, *, merge_lora: bool = True) -> None:
        with self.shared.using(self.adapter):
            if self.adapter is not None and not merge_lora:
                self._save_adapter(self.shared.module, Path(directory))
                return
            plain = self.shared.plain
            export_hf_directory(
                plain.config, merged_state(plain, self._key(), self._names()), self.tokenizer,
                directory, self.config.max_shard_bytes, architecture=self.shared.loaded.architecture,
                untie_embeddings=lora_unties_head(plain, self._key()),
                image_processor=self.images.processor if self.images is not None else None,
            )

    def _save_adapter(self, module: Any, directory: Path) -> None:
        """peft's adapter files, as a solo model's ``save_pretrained`` writes them."""
        assert self.adapter is not None  # called for a LoRA export: only an adapter's engine has one
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            save_peft_adapter(module, tmp, self.adapter.name)
            sub = Path(tmp) / self.adapter.name  # peft puts a non-default adapter's files in a subfolder
            items = [p for p in Path(tmp).iterdir() if p != sub] + (list(sub.iterdir()) if sub.is_dir() else [])
            for item in items:
                shutil.move(str(item), directory / item.name)
        for files in (self.tokenizer, (self.images.processor if self.images is not None else None)):
            if files is not None:
                files.save_pretrained(str(directory))


class AdapterEngine(_OnSharedBase):
    """One client's LoRA adapter on a shared base, with the local engine's API and arithmetic."""

    adapter: Adapter  # always one (the read-only base engine has none)

    def __init__(self, shared: AdapterPool, adapter: Adapter) -> None:
        super().__init__(shared, adapter)
        self.runner = adapter.runner

    # ---- compute ----------------------------------------------------------------------------------
    def run_steps(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool,
                  keep_grads_on_error: bool | None = None) -> Steps[EngineResult]:
        """One turn on the base per step: between its micro-batches the call holds no turn, and its
        adapter stays in memory (:meth:`~.pool.AdapterPool.calling`)."""
        with self.shared.calling(self.adapter):
            return (yield from each_step(lambda: self.shared.using(self.adapter),
                                         self.runner.steps(data, loss, backward=backward,
                                                           keep_grads_on_error=keep_grads_on_error)))

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        with self.shared.using(self.adapter):
            return super().optim_step(params, grad_scale)

    def zero_grad(self) -> None:
        with self.shared.using(self.adapter):
            super().zero_grad()

    # ---- state ------------------------------------------------------------------------------------
    def _solo_state(self) -> dict[str, torch.Tensor]:
        return solo_state(self.shared.module, self.adapter.name, self._names())

    def save_state(self, directory: Path) -> dict[str, Any]:
        with self.shared.using(self.adapter):
            weights, aliases = dedupe_shared(self._solo_state())
            save_tensors(weights, directory / WEIGHTS_FILE)
            self.runner.optimizer.save(directory / OPTIMIZER_FILE)
            return {"tied_aliases": aliases, "step": self.runner.optimizer.step_count}

    def state_layout(self) -> StateLayout:
        state = self._solo_state()
        _, aliases = dedupe_shared(dict(state))
        return StateLayout.of(state, self.runner.named_trainable(), aliases)

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        """Load the adapter's tensors; the checkpoint's base weights must equal the shared ones
        (one client never overwrites the base the others train on)."""
        with self.shared.using(self.adapter):
            step, _ = check_engine_metadata(metadata, str(directory))
            checked = check_state_files(directory, self.state_layout(), optimizer=optimizer, keep=True)
            assert checked.weights is not None  # keep=True returns them
            mine = dict(self.runner.named_trainable())
            live = self._solo_state()
            for key, tensor in checked.weights.items():
                if key not in mine and not torch.equal(tensor, live[key].detach().cpu()):
                    raise CheckpointError(
                        f"{directory}: base weight {key} differs from the shared base model's: this state was "
                        f"trained on another base (a client of a shared base loads its adapter only)"
                    )
            with torch.no_grad():
                for key, p in mine.items():
                    p.copy_(checked.weights[key])
            self.runner.zero_grad()
            self.runner.optimizer.restore(checked.moments if optimizer else None, step)

    def close(self) -> None:
        self.shared.remove_adapter(self.adapter)


class ReadOnlyBaseEngine(_OnSharedBase):
    """The shared base itself, read-only: forward, sampling and export (no training)."""

    def __init__(self, shared: AdapterPool) -> None:
        super().__init__(shared, None)
        self.runner = shared.base_runner

    def _read_only(self, what: str) -> InputError:
        return InputError(f"{what}: this Backend is the shared base model {self.shared.model_name}, which is "
                          f"read-only (its clients train LoRA adapters on it); train a LoRA Backend instead")

    def run_steps(self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool,
                  keep_grads_on_error: bool | None = None) -> Steps[EngineResult]:
        # keep_grads_on_error: nothing to keep on a read-only base (LocalEngine.run always passes it)
        if backward:
            raise self._read_only("forward_backward")
        return (yield from each_step(lambda: self.shared.using(None), self.runner.steps(data, loss, backward=False)))

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        raise self._read_only("optim_step")

    def zero_grad(self) -> None:
        pass

    def save_state(self, directory: Path) -> dict[str, Any]:
        raise self._read_only("save_state")

    def load_state(self, directory: Path, metadata: dict[str, Any], optimizer: bool) -> None:
        raise self._read_only("load_state")

    def copy_trainable(self, max_bytes: int) -> None:
        return None  # nothing trained

    def load_trainable(self, tensors: dict[str, torch.Tensor]) -> None:
        raise self._read_only("load_trainable")

    def close(self) -> None:
        pass  # the pool owns the base
