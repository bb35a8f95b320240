"""What a server is started with (``skyrl-sdk serve`` flags, or a test harness)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

from ..errors import InputError

API_KEY_ENV = "SKYRL_SDK_API_KEY"
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024


def _models(value: Any) -> tuple[str, ...]:
    if value is None:
        return ("tiny",)
    if isinstance(value, str):
        return (value,)
    models = tuple(str(v) for v in value)
    return models or ("tiny",)


def _engine_config(value: Any) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InputError(f"--engine-config: not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise InputError(f"--engine-config: expected a JSON object, got {type(value).__name__}")
    return dict(value)


@attrs.frozen
class ServerConfig:
    """Settings of one server.

    ``models``: the base models clients may name in ``create_model`` / sampling (``tiny`` or
    local Hugging Face directories). ``long_poll_s``: how long ``retrieve_future`` holds an
    unfinished request before answering ``try_again``. ``gap_timeout_s``: how long a
    model's worker must sit idle, with later requests waiting on a missing ``seq_id``,
    before those run anyway.
    """

    models: tuple[str, ...] = attrs.field(default=("tiny",), converter=_models)
    engine: str = "local"
    engine_config: dict[str, Any] = attrs.field(factory=dict, converter=_engine_config)
    state_dir: Path = attrs.field(default=Path("./skyrl-server-state"), converter=lambda p: Path(p).expanduser())
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    long_poll_s: float = 20.0
    gap_timeout_s: float = 60.0
    max_sampler_backends: int = 4
    max_ephemeral_snapshots: int = 4
    max_sample_batch: int = 64
    #: extra flags merged into the answer to the client's ``/client/config`` (e.g.
    #: ``{"fwdbwd_max_chunk_len": 256}``; see ``tinker.types.ClientConfigResponse``)
    client_config: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_args(cls, args: Any) -> "ServerConfig":
        """From ``skyrl-sdk serve``'s argparse namespace (host, port, model, engine,
        engine_config, state_dir, api_key). The API key falls back to $SKYRL_SDK_API_KEY."""
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        return cls(
            models=getattr(args, "model", None),
            engine=getattr(args, "engine", None) or "local",
            engine_config=getattr(args, "engine_config", None),
            state_dir=getattr(args, "state_dir", None) or "./skyrl-server-state",
            api_key=api_key,
            host=getattr(args, "host", None) or "127.0.0.1",
            port=int(getattr(args, "port", None) or 8000),
        )

    def model_names(self) -> Sequence[str]:
        return self.models
