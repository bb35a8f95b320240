"""What a server is started with (``skyrl-sdk serve`` flags, or a test harness)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..errors import InputError, quoted

logger = logging.getLogger(__name__)

API_KEY_ENV = "SKYRL_SDK_API_KEY"
DEFAULT_MAX_BODY_BYTES = 256 * 1024 * 1024
DEFAULT_SESSION_TIMEOUT_S = 300.0
DEFAULT_MAX_NUM_SAMPLES = 256
#: ``ServerConfig.max_sessions_per_owner``: an owner's sessions open at once (neither finished nor expired)
DEFAULT_MAX_SESSIONS_PER_OWNER = 256
#: ``--snapshot-memory`` when not given: in-memory weight snapshots of ephemeral sampling sessions
DEFAULT_SNAPSHOT_MEMORY = 2 * 1024**3
#: the owner of everything when the server has one key (``--api-key``) or none
DEFAULT_OWNER = "default"
#: third column of an ``--api-keys`` line that makes its owner an operator
OPERATOR_MARK = "operator"
#: the largest ``--api-keys`` file read
MAX_KEYS_FILE_BYTES = 2**20
#: keys shorter than this are warned about
SHORT_KEY_CHARS = 16
#: a comment in the ``--api-keys`` file: ``#`` at the start of a line or after white space
_COMMENT = re.compile(r"(^|\s)#.*")
#: ``--max-tokens-per-request``: above the tinker client's own chunks (5 MB of at least 12 bytes
#: per token: 416,666 tokens), so only a request made bigger on purpose is refused
DEFAULT_MAX_TOKENS_PER_REQUEST = 2**19
#: ``--max-queued-requests``: one owner's requests accepted and not finished
DEFAULT_MAX_QUEUED_REQUESTS = 1024
#: ``--header-timeout``: a connection must send its request line and headers within this
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: ``ServerConfig.max_recorded_bytes``: an owner's recorded sampled sequences, all sessions together
DEFAULT_MAX_RECORDED_BYTES = 256 * 2**20


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: Any, field: str = "--max-memory") -> int | None:
    """``"8GiB"``, ``"500MB"``, ``"123"`` or an integer -> bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise InputError(f"{field}: expected a size such as 8GiB, 500MB or a number of bytes, got {quoted(value)}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise InputError(f"{field}: expected a positive size, got {quoted(value)}")
    return size


def read_api_keys(path: str | os.PathLike, operators: set[str] | None = None) -> dict[str, str]:
    """``--api-keys FILE``: one ``KEY [OWNER]`` per line; blank lines and comments (from a
    ``#`` at the start of a line or after a space) skipped, so a ``#`` inside a key is part of
    it. Keys sharing an owner see the same things; a key without an owner is its own.

    The file must be a regular file of at most :data:`MAX_KEYS_FILE_BYTES` (a FIFO would block
    the start forever, ``/dev/zero`` never ends) in UTF-8; a key is printable ASCII (it travels
    in an HTTP header). The owner name ``default`` is refused: it is the owner of ``--api-key``
    and of a server without keys, and sharing it would merge the two. Warnings are logged for
    a file others may read and for keys shorter than :data:`SHORT_KEY_CHARS`.

    A line ``KEY OWNER operator`` also marks OWNER an operator (the console shows operators
    the server: docs/server.md); those owners are added to ``operators`` when it is given."""
    text = _read_keys_file(path)
    keys: dict[str, str] = {}
    short = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = _COMMENT.sub("", line).split()
        if not fields:
            continue
        where = f"--api-keys {path}, line {number}"
        if len(fields) == 3 and fields[2] == OPERATOR_MARK:  # the console's operators
            fields = fields[:2]
            if operators is not None:
                operators.add(fields[1])
        if len(fields) > 2:
            raise InputError(f"{where}: expected 'KEY [OWNER [operator]]', got {len(fields)} fields")
        key = fields[0]
        if not key.isascii() or not key.isprintable():
            raise InputError(f"{where}: a key must be printable ASCII (it is sent in the X-API-Key header)")
        if key in keys:
            raise InputError(f"{where}: this key is listed twice")
        if len(fields) == 2 and fields[1] == DEFAULT_OWNER:
            raise InputError(f"{where}: the owner name {DEFAULT_OWNER!r} is reserved (the owner of --api-key and of "
                             f"a server without keys); use another name")
        if len(key) < SHORT_KEY_CHARS:
            short.append(str(number))
        keys[key] = fields[1] if len(fields) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    if not keys:
        raise InputError(f"--api-keys {path}: no keys in the file")
    if short:
        logger.warning("--api-keys %s: the keys on line(s) %s are shorter than %d characters: easy to guess",
                       path, ", ".join(short), SHORT_KEY_CHARS)
    return keys


def _read_keys_file(path: str | os.PathLike) -> str:
    """The text of an ``--api-keys`` file, read without blocking and within the size limit."""
    try:
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except OSError as exc:
        raise InputError(f"--api-keys: cannot read {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"--api-keys {path}: not a regular file (a FIFO, device or directory); give a file")
        data = b""
        while len(data) <= MAX_KEYS_FILE_BYTES and (piece := os.read(fd, MAX_KEYS_FILE_BYTES + 1 - len(data))):
            data += piece
    finally:
        os.close(fd)
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise InputError(f"--api-keys {path}: larger than {MAX_KEYS_FILE_BYTES} bytes; is it the right file?")
    if mode & 0o044:
        logger.warning("--api-keys %s can be read by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--api-keys {path}: not UTF-8 text (byte {exc.start})") from None


def _models(value: Any) -> tuple[str, ...]:
    if value is None:
        return ("tiny",)
    if isinstance(value, str):
        return (value,)
    models = tuple(str(v) for v in value)
    return models or ("tiny",)


def _json_object(flag: str):
    def convert(value: Any) -> dict[str, Any]:
        if value is None or value == "":
            return {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InputError(f"{flag}: not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise InputError(f"{flag}: expected a JSON object, got {type(value).__name__}")
        return dict(value)
    return convert


_engine_config = _json_object("--engine-config")


@attrs.frozen
class ServerConfig:
    """Settings of one server.

    ``models``: the base models clients may name in ``create_model`` / sampling (``tiny`` or
    local Hugging Face directories). ``long_poll_s``: how long ``retrieve_future`` holds an
    unfinished request before answering ``try_again``. ``gap_timeout_s``: how long a
    model's worker must sit idle, with later chunks of a parallel ``forward_backward``
    waiting on a missing ``seq_id``, before those run anyway (only when ``client_config``
    turns ``parallel_fwdbwd_chunks`` on: otherwise a later request shows the missing one
    will not come, and it is skipped after ``boundary_grace_s``, a grace for clients of
    their own that send out of order; see ``futures.Sequencer``).

    ``api_key`` (one owner) and ``api_keys`` (key -> owner): who may call, and whose models,
    sessions, runs, checkpoints and futures each request sees; with neither, no key is needed
    and everything belongs to one owner. ``session_timeout_s``: a session with no heartbeat
    (and no request) for this long is finished and its models freed. ``max_seq_len`` caps
    every served model's own position limit; ``max_num_samples`` caps one sample request.
    """

    models: tuple[str, ...] = attrs.field(default=("tiny",), converter=_models)
    engine: str = "local"
    engine_config: dict[str, Any] = attrs.field(factory=dict, converter=_engine_config)
    #: what serves the sampling clients (``--sampler``; docs/engines.md, Samplers) and its options
    sampler: str = "transformers"
    sampler_config: dict[str, Any] = attrs.field(factory=dict, converter=_json_object("--sampler-config"))
    state_dir: Path = attrs.field(default=Path("./skyrl-server-state"), converter=lambda p: Path(p).expanduser())
    api_key: str | None = None
    api_keys: dict[str, str] = attrs.field(factory=dict)

    @api_keys.validator
    def _no_default_owner(self, _, value: dict[str, str]) -> None:
        if DEFAULT_OWNER in value.values():
            raise InputError(f"api_keys: the owner name {DEFAULT_OWNER!r} is reserved (the owner of --api-key and of "
                             f"a server without keys); use another name")
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    long_poll_s: float = 20.0
    gap_timeout_s: float = 60.0
    boundary_grace_s: float = 3.0
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
    #: tokens one forward / forward_backward request may hold; a bigger one is refused naming it
    max_tokens_per_request: int = DEFAULT_MAX_TOKENS_PER_REQUEST
    #: requests of one owner accepted and not yet finished; more are refused up front
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    #: sessions of one owner open at once (neither finished nor expired); more are refused
    max_sessions_per_owner: int = DEFAULT_MAX_SESSIONS_PER_OWNER
    #: a job of at most this many tokens may run between another job's micro-batches
    #: (docs/server.md, Fairness)
    turn_tokens: int = 8192
    #: the connection edge (``server/http/edge.py``): a connection's request line and headers must
    #: arrive within ``header_timeout_s`` (and the next request's within it of the last answer)
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: open connections; beyond it one that is idle, not reading its answer, trickling its body
    #: or long-polling beyond its owner's share makes room (None: min(1000, fd limit / 2))
    max_connections: int | None = None
    #: an answer the client does not read (the send buffer stays full) is dropped after this
    #: (nginx's send_timeout)
    send_timeout_s: float = 30.0
    #: requests a client may send before reading the answers; after this many in a row its
    #: connection is closed after the next answer
    max_pipelined_requests: int = 32
    #: an idle keep-alive connection is closed after this
    keep_alive_s: float = 5.0
    #: a request body must arrive within this (else 408)
    body_timeout_s: float = 120.0
    #: nor may it pause longer than this between two pieces (else 408; nginx's client_body_timeout)
    body_idle_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: ``--allowed-host``: names a server without API keys answers besides the loopback names and
    #: its ``--host`` (``*``: any; see ``server/http/origins.py``)
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: a JSON body, after zstd (the protobuf forward_backward keeps ``max_body_bytes``); the
    #: largest real one, a sample request's prompt, is under 1 MB even at 131072 tokens
    max_json_body_bytes: int = 4 * 2**20
    #: bytes of request bodies being read and parsed at once, all connections together (None:
    #: four times ``max_body_bytes``); beyond it requests get 503 and the client retries
    max_inflight_body_bytes: int | None = None
    #: bytes of failed results kept for retrieval (the oldest dropped first)
    max_failed_bytes: int = 64 * 2**20
    #: bytes of sequences one owner's sessions recorded with ``record_stability_info`` (for
    #: ``stable_reinforce``), all its sessions together; the least recently used beyond it are
    #: dropped (a session's are dropped when it ends)
    max_recorded_bytes: int = DEFAULT_MAX_RECORDED_BYTES
    #: Ctrl-C / SIGTERM: how long running work may take to stop before the process leaves it
    shutdown_s: float = 8.0
    #: extra flags merged into the answer to the client's ``/client/config`` (e.g.
    #: ``{"fwdbwd_max_chunk_len": 256}``; see ``tinker.types.ClientConfigResponse``)
    client_config: dict[str, Any] = attrs.field(factory=dict)

    @property
    def parallel_chunks(self) -> bool:
        """Whether clients send the chunks of one ``forward_backward`` in parallel (off unless
        ``client_config`` turns ``parallel_fwdbwd_chunks`` on)."""
        return bool(self.client_config.get("parallel_fwdbwd_chunks", False))

    @classmethod
    def from_args(cls, args: Any) -> ServerConfig:
        """From ``skyrl-sdk serve``'s argparse namespace (host, port, model, engine,
        engine_config, sampler, sampler_config, state_dir, api_key, api_keys, session_timeout, max_seq_len,
        max_num_samples, max_lora_adapters, max_memory, snapshot_memory, max_tokens_per_request,
        max_queued_requests, header_timeout, max_connections, allowed_host). The API key falls back to
        $SKYRL_SDK_API_KEY."""
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
        keys_file = getattr(args, "api_keys", None)
        limits = {"session_timeout_s": getattr(args, "session_timeout", None),
                  "max_seq_len": getattr(args, "max_seq_len", None),
                  "max_num_samples": getattr(args, "max_num_samples", None),
                  "max_lora_adapters": getattr(args, "max_lora_adapters", None),
                  "max_tokens_per_request": getattr(args, "max_tokens_per_request", None),
                  "max_queued_requests": getattr(args, "max_queued_requests", None),
                  "header_timeout_s": getattr(args, "header_timeout", None),
                  "max_connections": getattr(args, "max_connections", None)}
        for name, value in limits.items():
            if value is not None and not value > 0:
                raise InputError(f"--{name.removesuffix('_s').replace('_', '-')}: expected a positive number, "
                                 f"got {quoted(value)}")
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
            sampler=getattr(args, "sampler", None) or "transformers",
            sampler_config=getattr(args, "sampler_config", None),
            state_dir=getattr(args, "state_dir", None) or "./skyrl-server-state",
            api_key=api_key,
            allowed_hosts=getattr(args, "allowed_host", None) or (),
            host=getattr(args, "host", None) or "127.0.0.1",
            port=8000 if getattr(args, "port", None) is None else int(args.port),  # 0: a free port
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
