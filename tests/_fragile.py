"""Plugin losses that fail mid-call, for the all-or-nothing tests (issue 21).

``fragile_ce`` raises :class:`Boom` in its forward and ``oom_ce`` raises an out-of-memory
error in its backward, on the micro-batch holding a weight equal to :data:`MARK`
(:func:`marked` puts one on the shortest datum: the engine runs the longest first, so the
other micro-batches back-propagate before the failure). ``sum_only_ce`` returns no
per-token loss and does not declare one.
"""

from __future__ import annotations

import torch

import skyrl_sdk
from skyrl_sdk import types
from skyrl_sdk.losses import LossOutput

MARK = 13.0


class Boom(Exception):
    """What ``fragile_ce`` raises."""


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("simulated: CUDA out of memory in backward")


def marked(data: list[types.Datum]) -> list[types.Datum]:
    """``data`` with the shortest datum's first weight set to :data:`MARK`."""
    i = min(range(len(data)), key=lambda j: data[j].model_input.length)
    weights = data[i].loss_fn_inputs["weights"].array.copy()
    weights[0] = MARK
    datum = types.Datum(model_input=data[i].model_input, loss_fn_inputs={**data[i].loss_fn_inputs, "weights": weights})
    return [*data[:i], datum, *data[i + 1:]]


def declare(seen: list[str]) -> None:
    """Declare the losses in this process; each appends its name to ``seen`` per micro-batch."""
    common = dict(required_inputs=("target_tokens",), optional_inputs=("weights",))

    def per_token(batch, lp):
        return -lp * batch.mask()

    @skyrl_sdk.register_loss("fragile_ce", description="raises on a marked micro-batch",
                             outputs=("logprobs", "elementwise_loss"), **common)
    def fragile(batch, config):
        seen.append("fragile_ce")
        if bool((batch.mask() == MARK).any()):
            raise Boom("a plugin loss failed mid-call")
        loss = per_token(batch, batch.target_logprobs)
        return LossOutput(loss=loss.sum(), elementwise_loss=loss)

    @skyrl_sdk.register_loss("oom_ce", description="backward runs out of memory on a marked micro-batch",
                             outputs=("logprobs", "elementwise_loss"), **common)
    def oom(batch, config):
        seen.append("oom_ce")
        failing = bool((batch.mask() == MARK).any())
        loss = per_token(batch, _FailingBackward.apply(batch.target_logprobs) if failing else batch.target_logprobs)
        return LossOutput(loss=loss.sum(), elementwise_loss=loss)

    @skyrl_sdk.register_loss("sum_only_ce", description="no per-token loss", **common)
    def sum_only(batch, config):
        seen.append("sum_only_ce")
        return LossOutput(loss=per_token(batch, batch.target_logprobs).sum())
