"""REINFORCE for skyrl-sdk: ``loss = -sum(advantages * logprobs * weights)``.

A complete third-party loss plugin in one module. It is found through the ``skyrl_sdk``
entry point declared in this package's pyproject.toml and registered through the same
hook the built-in losses use, so every engine and both dialects can call it by name.
"""

from __future__ import annotations

from skyrl_sdk import LossInput, LossOutput, Register, hookimpl, metric_sum

__version__ = "0.1.0"


def reinforce(batch: LossInput, config: None) -> LossOutput:
    """Vanilla policy gradient on packed tokens; a plain sum, so micro-batching cannot change it."""
    lp = batch.require_target_logprobs()  # None only in a critic's input: refused by name
    adv = batch.inputs["advantages"]
    mask = batch.mask().to(lp.dtype)
    per_token = -(adv * lp * mask)
    # The positions metrics count: like the built-in policy losses, prompt positions that
    # Tinker clients send with advantage 0 and no weights are not "loss tokens".
    weights = batch.get("weights")
    scored = weights != 0 if weights is not None else adv != 0
    return LossOutput(
        loss=per_token.sum(),
        elementwise_loss=per_token,  # with its gradient: loss_reduction="seq_mean_token_mean" weights it
        scored=scored,
        metrics={
            "pg_loss:sum": metric_sum(per_token),
            "num_loss_tokens:sum": metric_sum(scored.float()),
        },
    )


@hookimpl
def skyrl_sdk_register_losses(register: Register) -> None:
    register(
        "reinforce",
        reinforce,
        description="REINFORCE policy gradient, -sum(advantages * logprobs * weights).",
        required_inputs=("target_tokens", "advantages"),
        # "logprobs" (the sampler's) is not read, but declared: the datums of
        # skyrl_sdk.rl.datum_from_sample (docs/rl.md) carry it and are taken as they are
        optional_inputs=("weights", "logprobs"),
        outputs=("logprobs", "elementwise_loss"),
    )
