"""The AdamW optimizer of one model, or of one rank's shard of it: created at the first step,
the gradient norm and clipping, the step under the guard of :mod:`.step_guard`, and its
state as ``<param>::exp_avg`` / ``::exp_avg_sq`` / ``::step`` tensors (the ``full`` state
format of every engine: :data:`~skyrl_sdk.models.checkpoint.OPTIMIZER_FILE`).

:class:`~.runner.ModelRunner` owns one as ``runner.optimizer``; the local, shared-base and
FSDP rank engines use it only through the public names below. A sharded engine hands its
collectives to the constructor (the runner passes its ``grad_norm`` and ``any_rank``), so
the guard decides the same on every rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from ..models.checkpoint import save_tensors
from ..types import AdamParams
from .step_guard import StepBound, measure_step

logger = logging.getLogger(__name__)

#: The per-parameter tensors of an AdamW state, as ``<param>::<kind>`` keys.
MOMENT_KINDS = ("exp_avg", "exp_avg_sq", "step")
NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` (0 for none): what clipping divides by."""
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def _same_flag(flag: bool) -> bool:
    return flag


class Optimizer:
    """AdamW over the parameters ``named_params()`` returns (asked at each use: a model may be
    rebuilt around the same parameters), with the step guard of :mod:`.step_guard`.

    ``grad_norm(grads)`` computes the global gradient norm and ``any_rank(flag)`` ORs a flag
    over ranks: a sharded engine passes its collectives, one process keeps the defaults.
    """

    def __init__(
        self,
        named_params: Callable[[], NamedParams],
        *,
        grad_norm: Callable[[list[torch.Tensor]], torch.Tensor] = total_norm,
        any_rank: Callable[[bool], bool] = _same_flag,
    ) -> None:
        self.named_params = named_params
        self.grad_norm = grad_norm
        self.any_rank = any_rank
        #: torch's AdamW, made by :meth:`create` (at the first step or load); None before
        self.torch_optimizer: torch.optim.Optimizer | None = None
        #: steps taken (skipped steps not counted); saved with the state
        self.step_count = 0
        #: (optimizer, bound on its state after its last step): a new optimizer or loaded
        #: moments forget it, and the next step measures instead
        self._bound: tuple[torch.optim.Optimizer, StepBound] | None = None

    # ---- lifetime -----------------------------------------------------------------------
    def create(self) -> torch.optim.Optimizer:
        """torch's AdamW over the parameters (fused where the kernel applies), made once."""
        if self.torch_optimizer is None:
            params = [p for _, p in self.named_params()]
            fused = _can_fuse_adamw(params)
            self.torch_optimizer = torch.optim.AdamW(params, lr=0.0, foreach=None, fused=fused or None)
        return self.torch_optimizer

    def release(self) -> None:
        """Free the moments (the step count stays): the next step or load creates them again."""
        self.torch_optimizer = None
        self._bound = None

    def reset(self) -> None:
        """A fresh optimizer at step 0 (a state loaded without its optimizer)."""
        self.release()
        self.step_count = 0

    # ---- the step -------------------------------------------------------------------------
    def step(self, adam: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        """Scale the pending gradients by ``grad_scale``, clip them to ``adam.grad_clip_norm``
        by their global norm, take one AdamW step with exactly ``adam`` unless it would make a
        weight or moment non-finite, and clear the gradients. Returns the step's metrics."""
        optimizer = self.create()
        trainable = [p for _, p in self.named_params()]
        with_grads = [p for p in trainable if p.grad is not None]
        grads = [p.grad for p in trainable if p.grad is not None]
        if not with_grads:
            logger.warning("optim_step without accumulated gradients (no forward_backward since the last step)")
        if grad_scale != 1.0 and grads:
            torch._foreach_mul_(grads, grad_scale)
        norm = self.grad_norm(grads)
        norm_value = float(norm)
        metrics = {"grad_norm": norm_value, "learning_rate": float(adam.learning_rate),
                   "no_gradient": float(not with_grads)}
        if not math.isfinite(norm_value):
            logger.warning("non-finite gradient norm (%s): skipping this optim_step", norm_value)
            return self._skipped(trainable, metrics, grad_norm_clipped=norm_value)
        clipped = adam.grad_clip_norm > 0 and norm_value > 0
        if clipped:
            torch.nn.utils.clip_grads_with_norm_(with_grads, adam.grad_clip_norm, norm)
        grad_max = min(norm_value, adam.grad_clip_norm) if adam.grad_clip_norm > 0 else norm_value
        metrics["grad_norm_clipped"] = grad_max
        for group in optimizer.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        bound = self._next_bound(optimizer, trainable, adam, grad_max)
        if bound is None:
            logger.warning("optim_step would make weights non-finite with %s: skipped, nothing changed", adam)
            return self._skipped(trainable, metrics, nonfinite_update=1.0)
        optimizer.step()
        self._bound = (optimizer, bound)
        for p in trainable:
            p.grad = None
        self.step_count += 1
        metrics.update(skipped=0.0, step=float(self.step_count))
        return metrics

    def _skipped(self, trainable: list[torch.nn.Parameter], metrics: dict, **extra: float) -> dict[str, float]:
        for p in trainable:
            p.grad = None
        metrics.update(extra, skipped=1.0, step=float(self.step_count))
        return metrics

    def _next_bound(self, optimizer: torch.optim.Optimizer, trainable: list[torch.nn.Parameter], adam: AdamParams,
                    grad_max: float) -> StepBound | None:
        """The bound on the state after the step about to run, or None when that step would
        make a weight or moment non-finite (on any rank). Usually scalar arithmetic on the last
        step's bound; the step is measured tensor by tensor when that cannot prove it."""
        if self._bound is not None and self._bound[0] is optimizer:
            bound = self._bound[1].after(adam, grad_max)
            if not self.any_rank(not bound.proves(adam)):
                return bound
        measured = measure_step(optimizer, trainable, adam)
        if self.any_rank(not measured.within_range()):
            return None
        return measured

    # ---- state as named tensors ---------------------------------------------------------------
    def state_items(self) -> list[tuple[str, torch.Tensor]]:
        """The moments and step counts as ``(<param>::<kind>, tensor)`` in saving order (a
        sharded model's are this rank's DTensors; the ``step`` a float32 tensor of shape (1,))."""
        optimizer = self.torch_optimizer
        if optimizer is None:
            return []
        items = []
        for name, p in self.named_params():
            state = optimizer.state.get(p)
            if not state:
                continue
            step = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu()
            items += [(f"{name}::exp_avg", state["exp_avg"]), (f"{name}::exp_avg_sq", state["exp_avg_sq"]),
                      (f"{name}::step", step)]
        return items

    def state_bytes(self) -> int:
        """Bytes the moments hold (this rank's shards)."""
        if self.torch_optimizer is None:
            return 0
        return sum(_local(t).numel() * _local(t).element_size() for state in self.torch_optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    def save(self, file: Path) -> None:
        """Write :meth:`state_items` into one safetensors file (an empty one before any step)."""
        save_tensors(dict(self.state_items()), file)

    def empty_state(self, steps: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """Uninitialised full-shape moments for the parameters named in ``steps`` (with those
        step counts): what a rank passes to :meth:`load_state_tensors` when another rank reads
        the file and scatters the values."""
        shapes = dict(self.named_params())
        tensors = {}
        for name, value in steps.items():
            like = shapes[name]
            tensors[f"{name}::exp_avg"] = torch.empty(like.shape, dtype=like.dtype)
            tensors[f"{name}::exp_avg_sq"] = torch.empty(like.shape, dtype=like.dtype)
            tensors[f"{name}::step"] = torch.tensor([value], dtype=torch.float32)
        return tensors

    def load_state_tensors(
        self, tensors: Mapping[str, torch.Tensor],
        from_full: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Replace the moments with ``tensors`` (checked already: :mod:`.state`); ``from_full(full,
        like)`` makes a parameter's moment of a full tensor (a sharded model scatters it)."""
        optimizer = self.create()
        optimizer.state.clear()
        self._bound = None  # new moments: the next step measures them
        conv = from_full or (lambda full, like: full.to(device=like.device, dtype=like.dtype))
        fused = optimizer.defaults.get("fused")
        for name, p in self.named_params():
            if f"{name}::exp_avg" not in tensors:
                continue
            optimizer.state[p] = {
                # the fused kernel wants its step counter beside the parameter
                "step": tensors[f"{name}::step"].reshape(()).clone().float().to(p.device if fused else "cpu"),
                "exp_avg": conv(tensors[f"{name}::exp_avg"], p.detach()),
                "exp_avg_sq": conv(tensors[f"{name}::exp_avg_sq"], p.detach()),
            }

    def restore(self, moments: Mapping[str, torch.Tensor] | None, step: int) -> None:
        """After a checkpoint's weights are in: take its moments and step count, or
        (``moments=None``) start fresh at step 0."""
        if moments is None:
            self.reset()
            return
        self.load_state_tensors(moments)
        self.step_count = int(step)

    def state_replaced(self, step: int) -> None:
        """The torch optimizer's state was loaded from outside (``torch.distributed.checkpoint``):
        forget the bound of the moments it had, and take ``step`` as the step count."""
        self._bound = None
        self.step_count = int(step)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _can_fuse_adamw(params: Iterable[torch.Tensor]) -> bool:
    """Floating tensors (plain, or DTensors whose shards are plain) on CPU or CUDA: torch's
    fused AdamW kernel applies.

    It computes the same update as the default implementation (to float rounding, ~1e-8
    relative) about 5x faster on CPU, where the for-loop AdamW is a visible part of a step,
    and makes no temporaries: on FSDP ranks the for-loop's ``sqrt(v)`` copy of the largest
    shard was the step's peak (benchmarks.fsdp_loading, docs/performance.md section 6).
    """
    params = list(params)
    if not params:
        return False
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p.data
        if type(local) is not torch.Tensor:
            return False
        if p.device.type not in ("cpu", "cuda") or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    return len({p.device for p in params}) == 1
