"""Config dialects: how a client's loss names and configs map onto native (SkyRL) losses.

- ``native``: SkyRL's loss names and config keys, taken as they are (plus SkyRL's critic
  alias ``ppo_critic_loss``).
- ``tinker``: the loss names and configs Tinker clients send. Tinker's clip thresholds are
  *absolute* ratio bounds (0.8, 1.2); the native losses take
  offsets (``eps_clip_low = 1 - clip_low_threshold``, ``eps_clip_high = clip_high_threshold - 1``).

A converter returns ``(native name, config)``, or ``None`` for a name it does not know: that
name then falls through to the loss registry, so a plugin's loss is callable from a Tinker
client by its own name. The loss terms every loss takes (``loss_reduction``, ``kl_coef``, ...
see :mod:`skyrl_sdk.losses.terms`) are the same in every dialect: they are split off before
a converter sees the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import LossConfigError, did_you_mean
from ..hooks import Register, hookimpl
from ..types.numbers import check_number, check_representable
from .terms import term_keys

#: Tinker loss name -> (native name for a policy, accepted Tinker config keys)
_POLICY = {
    "cross_entropy": ("cross_entropy", ()),
    "importance_sampling": ("importance_sampling", ()),
    "ppo": ("regular", ("clip_low_threshold", "clip_high_threshold")),
    "cispo": ("cispo", ("clip_low_threshold", "clip_high_threshold")),
    "dro": ("dro", ("beta",)),
    "gspo": ("gspo", ("clip_low_threshold", "clip_high_threshold")),
    "stable_reinforce": ("stable_reinforce", ("kl_coeff", "ratio_cap")),
}
#: On a critic, Tinker's ``ppo`` means the clipped value loss.
_CRITIC = {"ppo": ("value", ("value_clip",))}

#: Native config keys of the offset-style losses.
_OFFSET_KEYS = {
    "regular": ("eps_clip_low", "eps_clip_high"),
    "gspo": ("eps_clip_low", "eps_clip_high"),
    "cispo": ("cispo_eps_clip_low", "cispo_eps_clip_high"),
}


def _thresholds(cfg: Mapping[str, Any], loss: str) -> dict[str, float]:
    """Validate absolute thresholds and convert them to native offsets."""
    out: dict[str, float] = {}
    lo_key, hi_key = _OFFSET_KEYS[loss]
    lo = cfg.get("clip_low_threshold")
    hi = cfg.get("clip_high_threshold")
    for key, value in (("clip_low_threshold", lo), ("clip_high_threshold", hi)):
        if value is not None:
            check_number(f"loss_fn_config[{key!r}]", value, error=LossConfigError)
            check_representable(f"loss_fn_config[{key!r}]", value, error=LossConfigError)
    if lo is not None and not 0.0 <= lo <= 1.0:
        raise LossConfigError(
            f"loss_fn_config['clip_low_threshold']: expected 0 <= value <= 1 (an absolute ratio bound), got {lo}"
        )
    if hi is not None and hi < 1.0:
        raise LossConfigError(
            f"loss_fn_config['clip_high_threshold']: expected value >= 1 (an absolute ratio bound), got {hi}"
        )
    if lo is not None and hi is not None and lo > hi:
        raise LossConfigError(f"loss_fn_config: clip_low_threshold ({lo}) must not exceed clip_high_threshold ({hi})")
    if lo is not None:
        out[lo_key] = 1.0 - float(lo)
    if hi is not None:
        out[hi_key] = float(hi) - 1.0
    return out


def convert_tinker_loss_config(cfg: Mapping[str, Any] | None, loss: str = "regular") -> dict[str, float]:
    """Tinker's absolute clip thresholds -> native offsets.

    ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}`` ->
    ``{"eps_clip_low": 0.2, "eps_clip_high": 0.28}``. The loss terms (``loss_reduction``,
    ``kl_coef``, ...) are the same in both dialects and pass through unchanged. Unknown keys,
    and bounds with ``lo > 1``, ``hi < 1`` or ``lo > hi``, raise ``ValueError``.
    """
    cfg = dict(cfg or {})
    shared = term_keys("policy")
    accepted = ("clip_low_threshold", "clip_high_threshold") + shared
    for key in cfg:
        if key not in accepted:
            raise LossConfigError(f"unknown loss_fn_config key {key!r}; accepted keys: {list(accepted)}")
    return {**_thresholds(cfg, loss), **{k: v for k, v in cfg.items() if k in shared}}


def convert_tinker(loss_fn: str, loss_fn_config: Mapping[str, Any] | None,
                   role: str) -> tuple[str, dict[str, Any]] | None:
    table = _CRITIC if role == "critic" else _POLICY
    if loss_fn not in table:
        return None
    native, accepted = table[loss_fn]
    cfg = dict(loss_fn_config or {})
    for key in cfg:
        if key not in accepted:
            if not accepted:
                raise LossConfigError(
                    f"loss {loss_fn!r} takes no loss_fn_config of its own, got key {key!r}; "
                    f"keys every {role} loss takes: {list(term_keys(role))}"
                )
            everything = list(accepted) + list(term_keys(role))
            raise LossConfigError(
                f"loss {loss_fn!r}: unknown loss_fn_config key {key!r}; accepted keys: {everything}"
                f"{did_you_mean(key, everything)}"
            )
    if native in _OFFSET_KEYS:
        return native, _thresholds(cfg, native)
    return native, cfg


#: SkyRL's name for the critic's clipped value loss (``ppo_critic_loss``) -> native ``value``.
_CRITIC_ALIASES = {"ppo_critic_loss": "value"}


def convert_native(loss_fn: str, loss_fn_config: Mapping[str, Any] | None,
                   role: str) -> tuple[str, dict[str, Any]] | None:
    """Native names pass straight through to the loss registry (plus SkyRL's critic alias)."""
    if role == "critic" and loss_fn in _CRITIC_ALIASES:
        return _CRITIC_ALIASES[loss_fn], dict(loss_fn_config or {})
    return None


def tinker_config_keys(loss_fn: str, role: str, spec: Any) -> dict[str, Any] | None:
    """The config keys a Tinker client sends to ``loss_fn`` (resolved to ``spec``), with their
    defaults (an absolute bound's from the native offset's); None for a name the dialect does
    not claim (it falls through to the registry with the loss's own keys)."""
    table = _CRITIC if role == "critic" else _POLICY
    if loss_fn not in table:
        return None
    native, accepted = table[loss_fn]
    defaults = spec.config_defaults()
    if native in _OFFSET_KEYS:
        lo, hi = _OFFSET_KEYS[native]
        return {"clip_low_threshold": 1.0 - defaults[lo], "clip_high_threshold": 1.0 + defaults[hi]}
    return {key: defaults.get(key) for key in accepted}


convert_tinker.names = tuple(_POLICY)  # type: ignore[attr-defined]
convert_tinker.config_keys = tinker_config_keys  # type: ignore[attr-defined]


@hookimpl
def skyrl_sdk_register_dialects(register: Register) -> None:
    register("native", convert_native, description="Native (SkyRL) loss names and config keys, unchanged.")
    register(
        "tinker",
        convert_tinker,
        description="Tinker client names (ppo, cispo, dro, gspo, ...) with absolute clip thresholds.",
    )
