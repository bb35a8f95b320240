"""The micro-batch loop shared by engines, with the model's optimizer (:mod:`.optimizer`).

The local engine uses it directly; the FSDP engine runs one per rank on a sharded module.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..losses import LossInput
from ..losses.metrics import Metric, MetricAccumulator
from ..losses.resolve import ResolvedLoss
from ..losses.run import run_loss
from ..models.scoring import ScoringModel
from ..types import Datum
from .base import EngineResult, scores_key
from .batching import Layout, MicroBatch, make_micro_batches, pack_inputs
from .call_grads import call_gradients
from .optimizer import Optimizer, total_norm
from .sharing import PrefixSharing
from .turns import Steps, run_to_end

logger = logging.getLogger(__name__)

#: Show a progress bar when a call has at least this many micro-batches.
PROGRESS_MIN_MICRO_BATCHES = 8


class ModelRunner:
    """Runs a :class:`ScoringModel` over micro-batches; ``optimizer`` steps its parameters."""

    def __init__(
        self,
        scoring: ScoringModel,
        *,
        device: torch.device,
        micro_batch_tokens: int = 8192,
        batching: Layout = "bucket",
        pad_id: int = 0,
        loss_scale: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
        keep_grads_on_error: bool = True,
        prefix_min_tokens: int | None = None,
        compute_float32: bool = True,
    ) -> None:
        #: the module this runner scores with; ``None`` once its engine is closed (the model freed)
        self.scoring: ScoringModel | None = scoring
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
        #: AdamW over the trainable parameters (engines/optimizer.py), with this runner's
        #: collectives (a sharded runner overrides ``grad_norm`` and ``any_rank``)
        self.optimizer = Optimizer(self.named_trainable, grad_norm=self.grad_norm, any_rank=self.any_rank)
        self._trainable: tuple[object, list[tuple[str, torch.nn.Parameter]]] | None = None
        #: prefix sharing (engines/sharing.py): switched on now, checked at its first use
        self.prefix = PrefixSharing(scoring, prefix_min_tokens, float32=compute_float32)

    def scoring_model(self) -> ScoringModel:
        """:attr:`scoring`, refused once the engine is closed."""
        if self.scoring is None:
            raise RuntimeError("this engine is closed: its model was released")
        return self.scoring

    # ---- parameters -------------------------------------------------------------------
    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the optimizer steps (found once per model: walking every module of a
        large model on each step costs more than a LoRA step itself)."""
        model = self.scoring_model().model
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
        vision_language = self.scoring_model().vision_language
        batches = make_micro_batches(data, self.micro_batch_tokens, self.batching, self.pad_id, self.prefix.min_tokens,
                                     vision_language=vision_language)
        if self.prefix.pending and self.any_rank(any(mb.prefix is not None for mb in batches)):
            self.prefix.check(self.device, self.any_rank)
            if self.prefix.min_tokens is None:  # failed: this call runs unshared
                batches = make_micro_batches(data, self.micro_batch_tokens, self.batching, self.pad_id,
                                             vision_language=vision_language)
        return batches

    def run(
        self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool, batches: list | None = None,
        keep_grads_on_error: bool | None = None,
    ) -> EngineResult:
        """Score ``data``; ``batches`` is a precomputed :meth:`plan` (sharded engines count it first);
        ``keep_grads_on_error`` overrides :attr:`keep_grads_on_error` for this call."""
        return run_to_end(self.steps(data, loss, backward=backward, batches=batches,
                                     keep_grads_on_error=keep_grads_on_error))

    def steps(
        self, data: Sequence[Datum], loss: ResolvedLoss, *, backward: bool, batches: list | None = None,
        keep_grads_on_error: bool | None = None,
    ) -> Steps[EngineResult]:
        """:meth:`run` as a stepped call (:mod:`.turns`): it yields after every micro-batch but the
        last, with no graph alive and the finished micro-batches' gradients accumulated (kept apart
        from the pending ones until the call ends, :mod:`.call_grads`), so whoever drives it may run
        other calls there, or throw an exception in to stop it (the call then fails as on any error)."""
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
        keep = self.keep_grads_on_error if keep_grads_on_error is None else keep_grads_on_error
        on_device: list[tuple] = []  # each micro-batch's per-token outputs, read after the last one
        with call_gradients(params, keep=keep) if backward else contextlib.nullcontext():
            for i, mb in enumerate(progress):
                on_device.append((mb, self._run_micro_batch(data, mb, loss, backward, acc)))
                if i + 1 < len(batches):
                    yield  # a boundary: the driver may run other calls now, or stop this one
        _to_host(on_device, outputs)
        acc.add({"num_tokens:sum": Metric(float(sum(d.model_input.length for d in data)))})
        logger.debug("%s: %d datums in %d micro-batches", spec.name, len(data), len(batches))
        return EngineResult(outputs=outputs, metric_state=acc.state())  # type: ignore[arg-type]

    def _run_micro_batch(self, data: Sequence[Datum], mb: MicroBatch, loss: ResolvedLoss, backward: bool,
                         acc: MetricAccumulator) -> dict[str, torch.Tensor]:
        """One micro-batch's forward (and backward); returns its per-token outputs, still on the
        device: nothing here waits for the device (the metrics stay tensors too, read at the end)."""
        spec = loss.spec
        dev = self.device
        packed = pack_inputs(data, mb.datum_indices)
        inputs = {k: _to_device(torch.from_numpy(v), dev) for k, v in packed.items()}
        targets = inputs.get("target_tokens")
        grad_ctx = torch.enable_grad() if backward else torch.no_grad()
        with grad_ctx:
            with self.compute_precision():
                scores, entropy = self.scoring_model()(
                    _to_device(mb.input_ids, dev),
                    None if mb.attention_mask is None else _to_device(mb.attention_mask, dev),
                    None if mb.position_ids is None else _to_device(mb.position_ids, dev),
                    _to_device(mb.flat_index, dev),
                    targets,
                    prefix=None if mb.prefix is None else mb.prefix.to(dev),
                    images=None if mb.images is None else tuple(_to_device(t, dev) for t in mb.images),
                )
            kwargs = dict(
                inputs=inputs,
                segment_ids=_to_device(mb.segment_ids, dev),
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
        return {k: v.float() for k, v in per_token.items() if k in spec.outputs or k in out.extra_outputs}

    # ---- optimizer ---------------------------------------------------------------------
    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradients (overridden by sharded engines)."""
        return total_norm(grads)

    def any_rank(self, flag: bool) -> bool:
        """OR a flag over ranks (overridden by sharded engines)."""
        return flag


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device (a blocking copy to CUDA
    synchronizes the stream): from pinned memory, so the copy overlaps the compute queued before."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _to_host(on_device: list[tuple], outputs: list) -> None:
    """Every micro-batch's per-token outputs in host memory, one transfer per output name, cut
    into ``outputs`` per datum (the call's only wait for the device, with its metrics')."""
    for mb, _ in on_device:
        for idx in mb.datum_indices:
            outputs[idx] = {}
    keys = list(dict.fromkeys(k for _, per_token in on_device for k in per_token))
    for key in keys:
        parts = [(mb, per_token[key]) for mb, per_token in on_device if key in per_token]
        host = torch.cat([t for _, t in parts]).cpu().numpy()
        start = 0
        for mb, t in parts:
            rows = host[start:start + t.shape[0]]
            start += t.shape[0]
            for local, idx in enumerate(mb.datum_indices):
                outputs[idx][key] = rows[int(mb.offsets[local]):int(mb.offsets[local + 1])]
