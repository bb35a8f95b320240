"""Model + optimizer logic shared by engines: one micro-batch loop, one AdamW step.

The local engine uses it directly; the FSDP engine runs one per rank on a sharded module.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..losses import LossInput
from ..losses.metrics import Metric, MetricAccumulator
from ..losses.resolve import ResolvedLoss
from ..losses.run import run_loss
from ..models.scoring import ScoringModel
from ..types import AdamParams, Datum
from .base import EngineResult, scores_key
from .batching import make_micro_batches, pack_inputs
from .call_grads import call_gradients
from .sharing import PrefixSharing
from .step_guard import StepBound, measure_step
from .turns import between_micro_batches

logger = logging.getLogger(__name__)

#: Show a progress bar when a call has at least this many micro-batches.
PROGRESS_MIN_MICRO_BATCHES = 8


class ModelRunner:
    """Runs a :class:`ScoringModel` over micro-batches and steps its optimizer."""

    def __init__(
        self,
        scoring: ScoringModel,
        *,
        device: torch.device,
        micro_batch_tokens: int = 8192,
        batching: str = "bucket",
        pad_id: int = 0,
        loss_scale: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
        keep_grads_on_error: bool = True,
        prefix_min_tokens: int | None = None,
        compute_float32: bool = True,
    ) -> None:
        self.scoring = scoring
        self.device = device
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.batching = batching
        self.pad_id = pad_id
        #: multiplies every backward (e.g. to undo a data-parallel mean reduction)
        self.loss_scale = loss_scale
        #: mixed precision: the model's forward runs under ``torch.autocast`` in this dtype
        #: while parameters, gradients and AdamW moments keep theirs (float32)
        self.autocast_dtype = autocast_dtype
        #: a backward call that fails keeps the pending gradients (at the cost of one more
        #: gradient buffer while it runs; see :mod:`.call_grads`) or, False, drops them all
        self.keep_grads_on_error = keep_grads_on_error
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_count = 0
        #: (optimizer, bound on its state after its last step): see step_guard; a new optimizer
        #: or loaded moments forget it, and the next step measures instead
        self._bound: tuple[torch.optim.Optimizer, StepBound] | None = None
        self._trainable: tuple[object, list[tuple[str, torch.nn.Parameter]]] | None = None
        #: prefix sharing (engines/sharing.py): switched on now, checked at its first use
        self.prefix = PrefixSharing(scoring, prefix_min_tokens, float32=compute_float32)

    # ---- parameters -------------------------------------------------------------------
    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the optimizer steps (found once per model: walking every module of a
        large model on each step costs more than a LoRA step itself)."""
        model = self.scoring.model
        if self._trainable is None or self._trainable[0] is not model:
            self._trainable = (model, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
        return self._trainable[1]

    def has_pending_grads(self) -> bool:
        return any(p.grad is not None for _, p in self.named_trainable())

    def zero_grad(self) -> None:
        for _, p in self.named_trainable():
            p.grad = None

    # ---- forward / backward -----------------------------------------------------------
    def compute_precision(self) -> contextlib.AbstractContextManager:
        """The context the model's forward runs in: autocast to the compute dtype, or nothing.

        Only the forward is wrapped: autocast records its casts in the graph, so backward
        runs in the same dtypes, and gradients land in the parameters' own dtype (float32).
        Log-softmax, entropy and losses run in float32 whatever the compute dtype.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @property
    def prefix_status(self) -> str:
        """Whether prefix sharing is on, and why not (``get_info().prefix_sharing``)."""
        return self.prefix.status

    def plan(self, data: Sequence[Datum]) -> list:
        """The micro-batches this runner will use for ``data``; the first call that would share
        a prefix (on any rank) runs prefix sharing's self-test first."""
        vision_language = self.scoring.vision_language
        batches = make_micro_batches(data, self.micro_batch_tokens, self.batching, self.pad_id, self.prefix.min_tokens,
                                     vision_language=vision_language)
        if self.prefix.pending and self.any_rank(any(mb.prefix is not None for mb in batches)):
            self.prefix.check(self.device, self.any_rank)
            if self.prefix.min_tokens is None:  # failed: this call runs unshared
                batches = make_micro_batches(data, self.micro_batch_tokens, self.batching, self.pad_id,
                                             vision_language=vision_language)
        return batches

    def run(
        self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool, batches: list | None = None
    ) -> EngineResult:
        """Score ``data``; ``batches`` is a precomputed :meth:`plan` (sharded engines count it first)."""
        spec = loss.spec
        batches = self.plan(data) if batches is None else batches
        outputs: list[dict[str, np.ndarray] | None] = [None] * len(data)
        acc = MetricAccumulator()
        progress = tqdm(
            batches, desc="forward_backward" if backward else "forward", unit="mb",
            disable=len(batches) < PROGRESS_MIN_MICRO_BATCHES or None, leave=False,
        )
        # a call that fails mid-way leaves no partial gradient, and the pending ones as they were
        params = [p for _, p in self.named_trainable()] if backward else []
        with call_gradients(params, keep=self.keep_grads_on_error) if backward else contextlib.nullcontext():
            for i, mb in enumerate(progress):
                self._run_micro_batch(data, mb, loss, backward, outputs, acc)
                if i + 1 < len(batches):
                    between_micro_batches()  # a scheduler may give others a turn here, or stop the call
        acc.add({"num_tokens:sum": Metric(float(sum(d.model_input.length for d in data)))})
        logger.debug("%s: %d datums in %d micro-batches", spec.name, len(data), len(batches))
        return EngineResult(outputs=outputs, metric_state=acc.state())  # type: ignore[arg-type]

    def _run_micro_batch(self, data, mb, loss: ResolvedLoss, backward: bool, outputs, acc) -> None:
        spec = loss.spec
        dev = self.device
        packed = pack_inputs(data, mb.datum_indices)
        inputs = {
            k: torch.from_numpy(v).to(dev, non_blocking=True) for k, v in packed.items()
        }
        targets = inputs.get("target_tokens")
        grad_ctx = torch.enable_grad() if backward else torch.no_grad()
        with grad_ctx:
            with self.compute_precision():
                scores, entropy = self.scoring(
                    mb.input_ids.to(dev),
                    None if mb.attention_mask is None else mb.attention_mask.to(dev),
                    None if mb.position_ids is None else mb.position_ids.to(dev),
                    mb.flat_index.to(dev),
                    targets,
                    prefix=None if mb.prefix is None else mb.prefix.to(dev),
                    images=None if mb.images is None else tuple(t.to(dev) for t in mb.images),
                )
            kwargs = dict(
                inputs=inputs,
                segment_ids=mb.segment_ids.to(dev),
                num_segments=len(mb.datum_indices),
                entropy=entropy,
            )
            loss_input = LossInput.for_role(spec.role, scores, **kwargs)
            out, metrics = run_loss(loss, loss_input)
            if backward:
                total = out.loss * self.loss_scale if self.loss_scale != 1.0 else out.loss
                total.backward()
        acc.add(metrics)
        per_token = {scores_key(spec.role): scores.detach()}
        if out.elementwise_loss is not None:
            per_token["elementwise_loss"] = out.elementwise_loss.detach()
        for key, value in out.extra_outputs.items():
            per_token[key] = value.detach()
        host = {k: v.float().cpu().numpy() for k, v in per_token.items() if k in spec.outputs or k in out.extra_outputs}
        for local, idx in enumerate(mb.datum_indices):
            start, end = int(mb.offsets[local]), int(mb.offsets[local + 1])
            outputs[idx] = {k: v[start:end] for k, v in host.items()}

    # ---- optimizer --------------------------------------------------------------------
    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = [p for _, p in self.named_trainable()]
            fused = _can_fuse_adamw(params)
            self.optimizer = torch.optim.AdamW(params, lr=0.0, foreach=None, fused=fused or None)
        return self.optimizer

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradients (overridden by sharded engines)."""
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)

    def optim_step(self, params: AdamParams, grad_scale: float = 1.0) -> dict[str, float]:
        optimizer = self._ensure_optimizer()
        with_grads = [p for _, p in self.named_trainable() if p.grad is not None]
        grads = [p.grad for p in with_grads]
        if not with_grads:
            logger.warning("optim_step without accumulated gradients (no forward_backward since the last step)")
        if grad_scale != 1.0 and grads:
            torch._foreach_mul_(grads, grad_scale)
        norm = self.grad_norm(grads)
        norm_value = float(norm)
        metrics = {"grad_norm": norm_value, "learning_rate": float(params.learning_rate),
                   "no_gradient": float(not with_grads)}
        if not math.isfinite(norm_value):
            logger.warning("non-finite gradient norm (%s): skipping this optim_step", norm_value)
            self.zero_grad()
            metrics.update(skipped=1.0, grad_norm_clipped=norm_value, step=float(self.step_count))
            return metrics
        if params.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(with_grads, params.grad_clip_norm, norm)
            metrics["grad_norm_clipped"] = min(norm_value, params.grad_clip_norm)
        else:
            metrics["grad_norm_clipped"] = norm_value
        for group in optimizer.param_groups:
            group["lr"] = params.learning_rate
            group["betas"] = (params.beta1, params.beta2)
            group["eps"] = params.eps
            group["weight_decay"] = params.weight_decay
        grad_max = min(norm_value, params.grad_clip_norm) if params.grad_clip_norm > 0 else norm_value
        bound = self._next_bound(optimizer, params, grad_max)
        if bound is None:
            logger.warning("optim_step would make weights non-finite with %s: skipped, nothing changed", params)
            self.zero_grad()
            metrics.update(skipped=1.0, nonfinite_update=1.0, step=float(self.step_count))
            return metrics
        optimizer.step()
        self._bound = (optimizer, bound)
        self.zero_grad()
        self.step_count += 1
        metrics.update(skipped=0.0, step=float(self.step_count))
        return metrics

    def _next_bound(self, optimizer: torch.optim.Optimizer, params: AdamParams, grad_max: float) -> StepBound | None:
        """The bound on the state after the step about to run, or None when that step would
        make a weight or moment non-finite (on any rank). Usually scalar arithmetic on the last
        step's bound; the step is measured tensor by tensor when that cannot prove it."""
        trainable = [p for _, p in self.named_trainable()]
        if self._bound is not None and self._bound[0] is optimizer:
            bound = self._bound[1].after(params, grad_max)
            if not self.any_rank(not bound.proves(params)):
                return bound
        measured = measure_step(optimizer, trainable, params)
        if self.any_rank(not measured.within_range()):
            return None
        return measured

    def any_rank(self, flag: bool) -> bool:
        """OR a flag over ranks (overridden by sharded engines)."""
        return flag

    # ---- optimizer state as flat tensors (for safetensors checkpoints) -----------------
    def optimizer_tensors(
        self, to_full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    ) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {}
        out = {}
        for name, p in self.named_trainable():
            state = self.optimizer.state.get(p)
            if not state:
                continue
            out[f"{name}::exp_avg"] = to_full(state["exp_avg"])
            out[f"{name}::exp_avg_sq"] = to_full(state["exp_avg_sq"])
            out[f"{name}::step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu()
        return out

    def restore_after_load(self, moments: dict[str, torch.Tensor] | None, step: int) -> None:
        """After a checkpoint's weights are in: drop pending gradients, then take its AdamW
        moments and step count, or (``moments=None``) start a fresh optimizer at step 0."""
        self.zero_grad()
        if moments is None:
            self.optimizer = None
            self.step_count = 0
            return
        self.load_optimizer_tensors(moments)
        self.step_count = int(step)

    def load_optimizer_tensors(
        self, tensors: dict[str, torch.Tensor],
        from_full: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        optimizer = self._ensure_optimizer()
        optimizer.state.clear()
        self._bound = None  # new moments: the next step measures them
        for name, p in self.named_trainable():
            if f"{name}::exp_avg" not in tensors:
                continue
            conv = from_full or (lambda full, like: full.to(device=like.device, dtype=like.dtype))
            fused = optimizer.defaults.get("fused")
            optimizer.state[p] = {
                # the fused kernel wants its step counter beside the parameter
                "step": tensors[f"{name}::step"].reshape(()).clone().float().to(p.device if fused else "cpu"),
                "exp_avg": conv(tensors[f"{name}::exp_avg"], p.detach()),
                "exp_avg_sq": conv(tensors[f"{name}::exp_avg_sq"], p.detach()),
            }


def _can_fuse_adamw(params: Sequence[torch.Tensor]) -> bool:
    """Floating tensors (plain, or DTensors whose shards are plain) on CPU or CUDA: torch's
    fused AdamW kernel applies.

    It computes the same update as the default implementation (to float rounding, ~1e-8
    relative) about 5x faster on CPU, where the for-loop AdamW is a visible part of a step,
    and makes no temporaries: on FSDP ranks the for-loop's ``sqrt(v)`` copy of the largest
    shard was the step's peak (benchmarks.fsdp_loading, docs/performance.md section 6).
    """
    if not params:
        return False
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p.data
        if type(local) is not torch.Tensor:
            return False
        if p.device.type not in ("cpu", "cuda") or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    return len({p.device for p in params}) == 1
