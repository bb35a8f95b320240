"""A ``forward_backward`` call's gradients, kept apart from the pending ones until it succeeds.

Gradients of successive calls add up until ``optim_step``. A call that fails mid-way (a
plugin loss that raises, an out-of-memory error in backward) has already back-propagated
some of its micro-batches; accumulated in place, those can only be dropped together with
every earlier call's gradients. Here the pending gradients are set aside (moved, not copied)
before the call, the call accumulates into fresh ones, and only when it succeeds are the two
added; when it fails, its partial gradients are dropped and the pending ones put back, bit
for bit.

Cost: while a call runs on top of pending gradients both sets exist, one more buffer the
size of the trainable parameters' gradients (a LoRA adapter's, or for a full fine-tune the
model's), and one add per parameter ends the call (``benchmarks/call_grads.py``). With
``keep=False`` (``engine_config["keep_grads_on_error"] = False``) there is no extra buffer,
and a failure drops all pending gradients. Either way the exception records what happened
(:func:`outcome`), so the Backend keeps its count of calls since the last step right and says so.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import InputError

logger = logging.getLogger(__name__)

#: :func:`outcome` values: the gradients pending before the failed call are still there, or gone.
KEPT, DROPPED = "kept", "dropped"
_ATTR = "skyrl_pending_gradients"


def outcome(exc: BaseException) -> str | None:
    """What a failed backward call did to the pending gradients: :data:`KEPT`, :data:`DROPPED`,
    or ``None`` (the engine did not say: it failed before any backward, or is not in process)."""
    return getattr(exc, _ATTR, None)


@contextlib.contextmanager
def call_gradients(params: Sequence[torch.nn.Parameter], *, keep: bool = True) -> Iterator[None]:
    """Run one backward call on ``params``: its gradients are added to the pending ones only if
    the block succeeds; if it raises, only its own are dropped (all of them with ``keep=False``)."""
    pending = [p.grad for p in params]
    apart = keep and any(g is not None for g in pending)
    if apart:
        for p in params:
            p.grad = None
    try:
        yield
    except BaseException as exc:
        for p, g in zip(params, pending, strict=True):
            p.grad = g if keep else None
        dropped = not keep and any(g is not None for g in pending)
        setattr(exc, _ATTR, DROPPED if dropped else KEPT)
        if dropped:
            logger.error("forward_backward failed mid-call: the pending gradients of earlier calls were dropped "
                         "too (keep_grads_on_error is off)")
        raise
    if apart:
        _add(params, pending)


def _add(params: Sequence[torch.nn.Parameter], pending: Sequence[torch.Tensor | None]) -> None:
    """``p.grad = pending + p.grad`` for every parameter (either may be missing)."""
    olds, news = [], []
    for p, old in zip(params, pending, strict=True):
        if old is None:
            continue
        if p.grad is None:
            p.grad = old
            continue
        olds.append(old)
        news.append(p.grad)
        p.grad = old
    if olds:
        with torch.no_grad():
            torch._foreach_add_(olds, news)


def note_failure(exc: BaseException, earlier: int) -> int | None:
    """After a ``forward_backward`` that raised ``exc`` with ``earlier`` calls since the last step:
    say in the error what became of the pending gradients, and return the count of calls that
    still stands (0 when they were dropped), or None when the engine did not say."""
    kept = outcome(exc)
    if kept is None:
        return None
    what = f"the pending gradients of the {earlier} earlier forward_backward call(s) since the last step"
    if kept == DROPPED:
        note, earlier = f"{what} were dropped too (keep_grads_on_error=False)", 0
    else:
        note = f"{what} were kept as they were" if earlier else "no gradients were pending"
    notes = getattr(exc, "__notes__", None)
    exc.__notes__ = [*(notes if isinstance(notes, list) else []),
                     f"forward_backward failed mid-call: this call's partial gradients were dropped; {note}"]
    return earlier


def keep_option(run: Callable[..., Any], engine_name: str, keep: bool | None) -> dict[str, bool]:
    """The engine keyword for a per-call ``keep_grads_on_error`` (``run``: the engine's ``run``),
    refused by name when it is not a bool or the engine cannot take it."""
    if keep is None:
        return {}
    if not isinstance(keep, bool):
        raise InputError(f"keep_grads_on_error: expected true, false or None, got {keep!r}")
    if "keep_grads_on_error" not in inspect.signature(run).parameters:
        raise InputError(f"keep_grads_on_error: engine {engine_name!r} cannot choose it per call")
    return {"keep_grads_on_error": keep}
