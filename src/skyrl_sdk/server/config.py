"""What a server is started with (``skyrl-sdk serve`` flags, or a test harness)."""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ..errors import InputError, quoted
from . import settings
from .settings import API_KEY_ENV

logger = logging.getLogger(__name__)

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


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: Any, field: str = "--max-memory") -> int | None:
    """``"8GiB"``, ``"500MB"``, ``"123"`` or an integer -> bytes (None stays None)."""
    if value is None:
        return None
    number: float
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


def _json_object(flag: str) -> Callable[[Any], dict[str, Any]]:
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


def _declared(name: str, **kwargs: Any) -> Any:
    """The attrs field of setting ``name``, its default the declared one (:mod:`.settings`)."""
    if isinstance(settings.BY_NAME[name].default, (dict, list, set)):
        return attrs.field(factory=lambda: settings.default(name), **kwargs)
    return attrs.field(default=settings.BY_NAME[name].default, **kwargs)


@attrs.frozen
class ServerConfig:
    """Settings of one server: every field, its default and its meaning are declared once in
    :data:`.settings.SETTINGS` (``skyrl-sdk serve``'s flags set those that have one:
    :meth:`from_args`). The ones read most:

    ``models``: the base models clients may name in ``create_model`` / sampling (``tiny`` or
    local Hugging Face directories). ``api_key`` (one owner) and ``api_keys`` (key -> owner):
    who may call, and whose models, sessions, runs, checkpoints and futures each request sees;
    with neither, no key is needed and everything belongs to one owner.
    """

    models: tuple[str, ...] = _declared("models", converter=_models)
    engine: str = _declared("engine")
    engine_config: dict[str, Any] = _declared("engine_config", converter=_engine_config)
    sampler: str = _declared("sampler")
    sampler_config: dict[str, Any] = _declared("sampler_config", converter=_json_object("--sampler-config"))
    state_dir: Path = _declared("state_dir", converter=lambda p: Path(p).expanduser())
    api_key: str | None = _declared("api_key")
    api_keys: dict[str, str] = _declared("api_keys")

    @api_keys.validator
    def _no_default_owner(self, _: Any, value: dict[str, str]) -> None:
        if DEFAULT_OWNER in value.values():
            raise InputError(f"api_keys: the owner name {DEFAULT_OWNER!r} is reserved (the owner of --api-key and of "
                             f"a server without keys); use another name")
    host: str = _declared("host")
    port: int = _declared("port")
    seed: int = _declared("seed")
    max_body_bytes: int = _declared("max_body_bytes")
    long_poll_s: float = _declared("long_poll_s")
    gap_timeout_s: float = _declared("gap_timeout_s")
    boundary_grace_s: float = _declared("boundary_grace_s")
    max_sampler_backends: int = _declared("max_sampler_backends")
    max_ephemeral_snapshots: int = _declared("max_ephemeral_snapshots")
    max_sample_batch: int = _declared("max_sample_batch")
    sample_batch_wait_s: float = _declared("sample_batch_wait_s")
    session_timeout_s: float = _declared("session_timeout_s")
    max_seq_len: int | None = _declared("max_seq_len")
    max_num_samples: int = _declared("max_num_samples")
    share_base: bool = _declared("share_base")
    max_lora_adapters: int | None = _declared("max_lora_adapters")
    max_memory: int | None = _declared("max_memory", converter=lambda v: parse_bytes(v))
    snapshot_memory: int = _declared("snapshot_memory", converter=lambda v: parse_bytes(v, "--snapshot-memory"))
    operators: frozenset[str] = _declared("operators", converter=frozenset)
    max_tokens_per_request: int = _declared("max_tokens_per_request")
    max_queued_requests: int = _declared("max_queued_requests")
    max_sessions_per_owner: int = _declared("max_sessions_per_owner")
    turn_tokens: int = _declared("turn_tokens")
    header_timeout_s: float = _declared("header_timeout_s")
    max_connections: int | None = _declared("max_connections")
    send_timeout_s: float = _declared("send_timeout_s")
    max_pipelined_requests: int = _declared("max_pipelined_requests")
    keep_alive_s: float = _declared("keep_alive_s")
    body_timeout_s: float = _declared("body_timeout_s")
    body_idle_timeout_s: float = _declared("body_idle_timeout_s")
    allowed_hosts: tuple[str, ...] = _declared("allowed_hosts", converter=tuple)
    max_json_body_bytes: int = _declared("max_json_body_bytes")
    max_inflight_body_bytes: int | None = _declared("max_inflight_body_bytes")
    max_failed_bytes: int = _declared("max_failed_bytes")
    max_recorded_bytes: int = _declared("max_recorded_bytes")
    shutdown_s: float = _declared("shutdown_s")
    client_config: dict[str, Any] = _declared("client_config")

    @property
    def parallel_chunks(self) -> bool:
        """Whether clients send the chunks of one ``forward_backward`` in parallel (off unless
        ``client_config`` turns ``parallel_fwdbwd_chunks`` on)."""
        return bool(self.client_config.get("parallel_fwdbwd_chunks", False))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """From ``skyrl-sdk serve``'s parsed flags (:func:`.settings.add_flags`), read by their
        declared names: arguments without one of them are refused, naming it. A flag not given
        leaves its setting's default; the API key falls back to $SKYRL_SDK_API_KEY, ``--api-keys``
        is read as a file (its operators too)."""
        given = settings.flag_values(args)
        for s in settings.FLAGS:
            value = given[s.name]
            if s.positive and value is not None and not value > 0:
                raise InputError(f"{s.flag}: expected a positive number, got {quoted(value)}")
        operators: set[str] = set()
        given["api_keys"] = read_api_keys(given["api_keys"], operators) if given["api_keys"] else None
        given["api_key"] = given["api_key"] or os.environ.get(API_KEY_ENV) or None
        return cls(operators=frozenset(operators),
                   **{name: value for name, value in given.items() if value is not None})

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
