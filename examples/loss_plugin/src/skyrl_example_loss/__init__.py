"""``clipped_pg``: policy gradient with advantages clipped to ``[-c, c]``.

An example loss plugin with a config and masked ``:mean`` metrics. Install it with
``pip install -e examples/loss_plugin`` (restart a running ``skyrl-sdk serve`` afterwards)
and call it by name: ``backend.forward_backward(data, "clipped_pg", {"max_abs_advantage": 2.0})``.
"""

from __future__ import annotations

import attrs

from skyrl_sdk import LossInput, LossOutput, hookimpl, metric_mean, metric_sum, number_validator


@attrs.frozen
class ClippedPGConfig:
    """``loss_fn_config`` keys: every field needs a default; validators run before any compute."""

    max_abs_advantage: float = attrs.field(default=5.0, validator=number_validator(0.0, low_open=True))


def clipped_pg(batch: LossInput, config: ClippedPGConfig) -> LossOutput:
    lp = batch.require_target_logprobs()             # (T,) packed tokens of every datum, differentiable
    adv = batch.inputs["advantages"]
    clipped = adv.clamp(-config.max_abs_advantage, config.max_abs_advantage)
    per_token = -(clipped * lp * batch.mask().to(lp.dtype))
    weights = batch.get("weights")
    scored = weights != 0 if weights is not None else adv != 0   # completion tokens, not the prompt
    return LossOutput(
        loss=per_token.sum(),                        # a sum: the same under any micro-batching
        elementwise_loss=per_token,                  # not detached: loss_reduction="seq_mean_token_mean" uses it
        scored=scored,
        metrics={
            "pg_loss:sum": metric_sum(per_token),
            # mask=: average over the completion tokens only; without it the prompt
            # positions (advantage 0) would pull the mean towards 0
            "logprob:mean": metric_mean(lp.detach(), mask=scored),
            "advantage_clipped:mean": metric_mean((clipped != adv).float(), mask=scored),
        },
    )


@hookimpl
def skyrl_sdk_register_losses(register):
    register(
        "clipped_pg",
        clipped_pg,
        description="Policy gradient with advantages clipped to [-max_abs_advantage, max_abs_advantage].",
        required_inputs=("target_tokens", "advantages"),
        # "logprobs" (the sampler's) is not read, but declared: the datums of
        # skyrl_sdk.rl.datum_from_sample (docs/rl.md) carry it and are taken as they are
        optional_inputs=("weights", "logprobs"),
        config_cls=ClippedPGConfig,
        outputs=("logprobs", "elementwise_loss"),
    )
