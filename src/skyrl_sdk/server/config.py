"""What a server is started with (``skyrl-sdk serve`` flags, or a test harness)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..errors import InputError
from .memory import parse_bytes

API_KEY_ENV = "SKYRL_SDK_API_KEY"
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
DEFAULT_SESSION_TIMEOUT_S = 300.0
DEFAULT_MAX_NUM_SAMPLES = 256
#: ``--snapshot-memory`` when not given: in-memory weight snapshots of ephemeral sampling sessions
DEFAULT_SNAPSHOT_MEMORY = 2 * 1024**3
#: the owner of everything when the server has one key (``--api-key``) or none
DEFAULT_OWNER = "default"
#: third column of an ``--api-keys`` line that makes its owner an operator
OPERATOR_MARK = "operator"


def read_api_keys(path: str | os.PathLike, operators: set[str] | None = None) -> dict[str, str]:
    """``--api-keys FILE``: one ``KEY [OWNER]`` per line (``#`` comments and blank lines
    skipped). Keys sharing an owner see the same things; a key without an owner is its own.
    A line ``KEY OWNER operator`` also marks OWNER an operator (the console shows operators
    the server: docs/server.md); those owners are added to ``operators`` when it is given."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise InputError(f"--api-keys: cannot read {path}: {exc.strerror}") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) == 3 and fields[2] == OPERATOR_MARK:  # the console's operators (issue 25)
            fields = fields[:2]
            if operators is not None:
                operators.add(fields[1])
        if len(fields) > 2:
            raise InputError(f"--api-keys {path}, line {number}: expected 'KEY [OWNER [operator]]', got "
                             f"{len(fields)} fields")
        key = fields[0]
        if key in keys:
            raise InputError(f"--api-keys {path}, line {number}: this key is listed twice")
        keys[key] = fields[1] if len(fields) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if not keys:
        raise InputError(f"--api-keys {path}: no keys in the file")
    return keys


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

    ``api_key`` (one owner) and ``api_keys`` (key -> owner): who may call, and whose models,
    sessions, runs, checkpoints and futures each request sees; with neither, no key is needed
    and everything belongs to one owner. ``session_timeout_s``: a session with no heartbeat
    (and no request) for this long is finished and its models freed. ``max_seq_len`` caps
    every served model's own position limit; ``max_num_samples`` caps one sample request.
    """

    models: tuple[str, ...] = attrs.field(default=("tiny",), converter=_models)
    engine: str = "local"
    engine_config: dict[str, Any] = attrs.field(factory=dict, converter=_engine_config)
    state_dir: Path = attrs.field(default=Path("./skyrl-server-state"), converter=lambda p: Path(p).expanduser())
    api_key: str | None = None
    api_keys: dict[str, str] = attrs.field(factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    long_poll_s: float = 20.0
    gap_timeout_s: float = 60.0
    max_sampler_backends: int = 4
    max_ephemeral_snapshots: int = 4
    max_sample_batch: int = 64
    #: how long a sampler waits for another compatible sample request before running the ones
    #: it has (a client sends a group's requests a few ms apart; see futures.Worker)
    sample_batch_wait_s: float = 0.005
    session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S
    max_seq_len: int | None = None
    max_num_samples: int = DEFAULT_MAX_NUM_SAMPLES
    #: LoRA clients of a served model share one copy of its weights (local engine; docs/server.md)
    share_base: bool = True
    #: adapters per shared base whose tensors stay in memory (the least recently used beyond
    #: it wait in the state dir); None: no limit
    max_lora_adapters: int | None = None
    #: bytes the loaded models may take (shared bases, adapters, own copies); None: no limit
    max_memory: int | None = attrs.field(default=None, converter=lambda v: parse_bytes(v))
    #: bytes of in-memory weight snapshots (ephemeral sampling sessions) over all models; the
    #: least recently used beyond it are evicted (docs/server.md)
    snapshot_memory: int = attrs.field(default=DEFAULT_SNAPSHOT_MEMORY,
                                       converter=lambda v: parse_bytes(v, "--snapshot-memory"))
    #: owners who see the server in the console (marked ``operator`` in ``--api-keys``; the
    #: ``--api-key`` holder always does: see :meth:`is_operator`)
    operators: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    #: extra flags merged into the answer to the client's ``/client/config`` (e.g.
    #: ``{"fwdbwd_max_chunk_len": 256}``; see ``tinker.types.ClientConfigResponse``)
    client_config: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_args(cls, args: Any) -> ServerConfig:
        """From ``skyrl-sdk serve``'s argparse namespace (host, port, model, engine,
        engine_config, state_dir, api_key, api_keys, session_timeout, max_seq_len,
        max_num_samples, max_lora_adapters, max_memory, snapshot_memory). The API key falls back to
        $SKYRL_SDK_API_KEY."""
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        keys_file = getattr(args, "api_keys", None)
        limits = {"session_timeout_s": getattr(args, "session_timeout", None),
                  "max_seq_len": getattr(args, "max_seq_len", None),
                  "max_num_samples": getattr(args, "max_num_samples", None),
                  "max_lora_adapters": getattr(args, "max_lora_adapters", None)}
        for name, value in limits.items():
            if value is not None and not value > 0:
                raise InputError(f"--{name.removesuffix('_s').replace('_', '-')}: expected a positive number, "
                                 f"got {value!r}")
        operators: set[str] = set()
        return cls(
            share_base=getattr(args, "share_base", None) is not False,
            api_keys=read_api_keys(keys_file, operators) if keys_file else {},
            operators=operators,
            max_memory=getattr(args, "max_memory", None),
            snapshot_memory=getattr(args, "snapshot_memory", None) or DEFAULT_SNAPSHOT_MEMORY,
            **{k: v for k, v in limits.items() if v is not None},
            models=getattr(args, "model", None),
            engine=getattr(args, "engine", None) or "local",
            engine_config=getattr(args, "engine_config", None),
            state_dir=getattr(args, "state_dir", None) or "./skyrl-server-state",
            api_key=api_key,
            host=getattr(args, "host", None) or "127.0.0.1",
            port=int(getattr(args, "port", None) or 8000),
        )

    def owners(self) -> dict[str, str] | None:
        """API key -> owner, or None when no key is needed (everything is ``DEFAULT_OWNER``'s)."""
        keys = dict(self.api_keys)
        if self.api_key:
            keys.setdefault(self.api_key, DEFAULT_OWNER)
        return keys or None

    def is_operator(self, owner: str) -> bool:
        """Whether ``owner`` sees the whole server in the console: owners marked ``operator`` in
        ``--api-keys``, the ``--api-key`` holder, and with no key at all the one default owner."""
        return owner in self.operators or (owner == DEFAULT_OWNER and (bool(self.api_key) or not self.api_keys))


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches only this machine (a server there needs no API key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
