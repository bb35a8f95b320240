"""Every setting of a server, declared once: its name, type, default and help (as datasette's
``SETTINGS``), and the flag of ``skyrl-sdk serve`` that sets it, if any.

:data:`SETTINGS` is read by everything that names a setting: ``ServerConfig`` (its fields and
their defaults, ``server/config.py``), ``skyrl-sdk serve``'s parser and ``--help``
(:func:`add_flags`), the flags table of docs/server.md (:func:`render_flags_table`; ``python -m
skyrl_sdk.server.settings`` prints it) and the console's limits table (``console=True``). The
parser's destinations are the settings' names, and :func:`flag_values` reads a parsed namespace
by them, refusing one that lacks a declared flag: a renamed or missing flag fails loudly instead
of falling back to its default. ``tests/test_settings.py`` holds the rest to it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import attrs

#: the environment variable ``--api-key`` falls back to
API_KEY_ENV = "SKYRL_SDK_API_KEY"
#: the markers of docs/server.md's flags table (between them, :func:`render_flags_table`)
MARK_START, MARK_END = "<!-- serve-flags:start -->", "<!-- serve-flags:end -->"


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value (argparse names the flag when it is not one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


@attrs.frozen
class Setting:
    """One setting: ``name`` is its ``ServerConfig`` field (and the parsed flag's destination)."""

    name: str
    #: its value when not given (a mutable one is copied for each config)
    default: Any
    #: what it does, in docs/server.md's words (markdown backticks; ``--help`` drops them)
    help: str
    #: ``skyrl-sdk serve``'s flag, or None (set by ``ServerConfig(...)`` only)
    flag: str | None = None
    #: the flag's value from its text (argparse's ``type``); the config's converter does the rest
    type: Callable[[str], Any] = str
    metavar: str | None = None
    #: the default in words, where the value alone would not say it (``None`` -> "no limit")
    shown: str | None = None
    #: a flag given several times (its values a list)
    repeat: bool = False
    #: ``--flag`` / ``--no-flag``
    switch: bool = False
    #: a number that must be positive (checked when the flags are read, naming the flag)
    positive: bool = False
    #: a row of the console's limits table, and how it shows the value ("bytes", "s")
    console: bool = False
    unit: str | None = None

    @property
    def default_text(self) -> str:
        """The default as the docs say it (markdown; ``--help`` drops the backticks)."""
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, (tuple, list)):
            return ", ".join(f"`{v}`" for v in self.default)
        return f"`{self.default:g}`" if isinstance(self.default, float) else f"`{self.default}`"


_S = Setting
MiB, GiB = 2**20, 2**30

SETTINGS: tuple[Setting, ...] = (
    # ---- the flags of `skyrl-sdk serve`, in docs/server.md's order
    _S("host", "127.0.0.1", "bind address (loopback unless told otherwise; a non-loopback bind without a key logs a "
       "warning)", flag="--host"),
    _S("port", 8000, "`0` binds a free port, printed in the `listening on` line (for scripts and tests)", flag="--port",
       type=int),
    _S("models", ("tiny",), "a base model clients may name: `tiny` or a local Hugging Face directory; repeatable",
       flag="--model", metavar="NAME_OR_DIR", repeat=True, console=True),
    _S("engine", "local", "execution engine (`fsdp` with the skyrl-sdk-fsdp plugin)", flag="--engine", console=True),
    _S("engine_config", {}, "engine options, e.g. `'{\"device\": \"cuda\", \"dtype\": \"bfloat16\"}'`",
       flag="--engine-config", type=json_object, metavar="JSON", shown="none"),
    _S("sampler", "transformers", "what serves the sampling clients: the built-in decode loop, or `vllm` with the "
       "skyrl-sdk-vllm plugin (`plugins/skyrl-sdk-vllm`: `pip install -e` it from the checkout; see Samplers)",
       flag="--sampler", console=True),
    _S("sampler_config", {}, "the sampler's options, e.g. `'{\"gpu_memory_utilization\": 0.4}'`",
       flag="--sampler-config", type=json_object, metavar="JSON", shown="none", console=True),
    _S("state_dir", "./skyrl-server-state", "SQLite records and checkpoint files", flag="--state-dir", metavar="DIR"),
    _S("api_key", None, "when set, every request must carry `X-API-Key: KEY` (one owner)", flag="--api-key",
       metavar="KEY", shown=f"`${API_KEY_ENV}`"),
    _S("api_keys", {}, "several keys with owners: one 'KEY [OWNER [operator]]' per line, each owner seeing only its "
       "own things; a key without OWNER is an owner of its own; a third column 'operator' lets that owner see the "
       "whole server in the console (see Owners below)", flag="--api-keys", metavar="FILE", shown="none"),
    _S("session_timeout_s", 300.0, "a session with no heartbeat (and no request) for S seconds is finished and its "
       "models freed", flag="--session-timeout", type=float, metavar="S", positive=True, console=True,
       unit="s"),
    _S("max_seq_len", None, "longest datum, and longest prompt + `max_tokens`, accepted", flag="--max-seq-len",
       type=int, metavar="N", shown="the model's `max_position_embeddings`", positive=True, console=True),
    _S("max_num_samples", 256, "most samples one sample request may ask for", flag="--max-num-samples", type=int,
       metavar="N", positive=True, console=True),
    _S("share_base", True, "LoRA clients of a model share one copy of its weights; `--no-share-base` gives each its "
       "own copy (see Many clients on one base)", flag="--share-base", switch=True, console=True),
    _S("max_lora_adapters", None, "LoRA adapters per shared base kept in memory; the least recently used beyond N "
       "wait on disk (see Many clients on one base)", flag="--max-lora-adapters", type=int, metavar="N",
       shown="no limit", positive=True, console=True),
    _S("max_memory", None, "memory the loaded models may take (`8GiB`, `500MB`, bytes); a model that would exceed "
       "it is refused with an error", flag="--max-memory", metavar="SIZE", shown="no limit", console=True,
       unit="bytes"),
    _S("snapshot_memory", 2 * GiB, "memory for the in-memory weight snapshots of "
       "`save_weights_and_get_sampling_client` sessions, all models together; the least recently used beyond it "
       "are evicted (see Sampling)", flag="--snapshot-memory", metavar="SIZE", shown="`2GiB`", console=True,
       unit="bytes"),
    _S("max_tokens_per_request", 2**19, "tokens one `forward` / `forward_backward` request may hold; a bigger one is "
       "refused naming the flag (above the tinker client's own chunks; see Fairness)",
       flag="--max-tokens-per-request", type=int, metavar="N", positive=True, console=True),
    _S("max_queued_requests", 1024, "requests one owner may have accepted and unfinished; more are refused up "
       "front (see Fairness)", flag="--max-queued-requests", type=int, metavar="N", positive=True, console=True),
    _S("header_timeout_s", 10.0, "a connection must send its request line and headers within S seconds of "
       "connecting (or of its last answer), else it is closed (see The connection edge)", flag="--header-timeout",
       type=float, metavar="S", positive=True, console=True, unit="s"),
    _S("max_connections", None, "open connections; beyond N one makes room: the oldest idle one, else the one not "
       "reading its answer longest, else the one whose request body has gone longest without a byte, else the oldest "
       "long-poll of an owner over its share (see The connection edge)", flag="--max-connections", type=int,
       metavar="N", shown="`1000`, at most half the open-file limit", positive=True, console=True),
    _S("allowed_hosts", (), "without an API key the server answers only requests whose `Host` is a loopback name "
       "(`localhost`, `127.0.0.1`, `::1`) or `--host`; this allows NAME too (`*`: any); repeatable (see Security)",
       flag="--allowed-host", metavar="NAME", repeat=True, shown="none"),
    # ---- settings with no flag (ServerConfig(...) sets them: tests, embedding applications)
    _S("seed", 0, "the seed of the models the server builds"),
    _S("operators", frozenset(), "owners who see the server in the console (marked `operator` in `--api-keys`; the "
       "`--api-key` holder always does)"),
    _S("max_body_bytes", 256 * MiB, "a `forward_backward` request body (protobuf; declared, sent, chunked, or after "
       "zstd)", console=True, unit="bytes"),
    _S("max_json_body_bytes", 4 * MiB, "a JSON body, after zstd (the largest real one, a sample request's prompt, "
       "is under 1 MB even at 131072 tokens)"),
    _S("max_inflight_body_bytes", None, "bytes of request bodies being read and parsed at once, all connections "
       "together; beyond it requests get 503 and the client retries", shown="4 x `max_body_bytes`"),
    _S("long_poll_s", 20.0, "how long `retrieve_future` holds an unfinished request before answering `try_again`"),
    _S("gap_timeout_s", 60.0, "how long a model's queue must sit idle, with later chunks of a parallel "
       "`forward_backward` waiting on a missing `seq_id`, before those run anyway (only when `client_config` turns "
       "`parallel_fwdbwd_chunks` on)"),
    _S("boundary_grace_s", 3.0, "how long a request that shows the `seq_id`s below it will not come waits for a "
       "client of its own that sends out of order, before those are skipped"),
    _S("max_sampler_backends", 4, "sampler Backends (base models, saved paths) kept loaded; the least recently "
       "used beyond it are closed"),
    _S("max_ephemeral_snapshots", 4, "weight snapshots kept per training model for "
       "`save_weights_and_get_sampling_client` sessions"),
    _S("max_sample_batch", 64, "compatible sample requests run together as one batch"),
    _S("sample_batch_wait_s", 0.005, "how long a sampler waits for another compatible sample request before "
       "running the ones it has (a client sends a group's requests a few ms apart)"),
    _S("max_sessions_per_owner", 256, "sessions of one owner open at once (neither finished nor expired); more are "
       "refused"),
    _S("turn_tokens", 8192, "a job of at most this many tokens may run between another job's micro-batches (see "
       "Fairness)"),
    _S("send_timeout_s", 30.0, "an answer the client does not read (the send buffer stays full) is dropped after "
       "this (nginx's `send_timeout`; see The connection edge)"),
    _S("max_pipelined_requests", 32, "requests a client may send before reading the answers; after this many in a "
       "row its connection is closed after the next answer"),
    _S("keep_alive_s", 5.0, "an idle keep-alive connection is closed after this"),
    _S("body_timeout_s", 120.0, "a request body must arrive within this (else 408)"),
    _S("body_idle_timeout_s", 10.0, "nor may it pause longer than this between two pieces (else 408; nginx's "
       "`client_body_timeout`)"),
    _S("max_failed_bytes", 64 * MiB, "bytes of failed results kept for retrieval (the oldest dropped first)"),
    _S("max_recorded_bytes", 256 * MiB, "bytes of sequences one owner's sessions recorded with "
       "`record_stability_info` (for `stable_reinforce`), all its sessions together; the least recently used beyond "
       "it are dropped (a session's are dropped when it ends)", unit="bytes"),
    _S("shutdown_s", 8.0, "Ctrl-C / SIGTERM: how long running work may take to stop before the process leaves it"),
    _S("client_config", {}, "extra flags merged into the answer to the client's `/client/config` (e.g. "
       "`{\"fwdbwd_max_chunk_len\": 256}`; see `tinker.types.ClientConfigResponse`)"),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
#: the settings ``skyrl-sdk serve`` has a flag for
FLAGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.flag is not None)


def default(name: str) -> Any:
    """Setting ``name``'s default (a fresh copy of a mutable one)."""
    value = BY_NAME[name].default
    return type(value)(value) if isinstance(value, (dict, list, set)) else value


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of :data:`FLAGS` to ``serve``'s parser, its destination the setting's name
    and its help the declared one with the default. A repeatable flag, the JSON ones and the API
    keys file parse to None when not given (the config fills in the default)."""
    for s in FLAGS:
        assert s.flag is not None  # FLAGS: the settings with a flag
        text = f"{s.help} (default: {s.default_text})".replace("`", "").replace("%", "%%")
        if s.switch:
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=s.default,
                                help=text)
            continue
        given_default = None if s.repeat or isinstance(s.default, dict) else s.default
        parser.add_argument(s.flag, dest=s.name, type=s.type, metavar=s.metavar, help=text, default=given_default,
                            action="append" if s.repeat else "store")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """Setting name -> the value ``args`` holds for its flag. A namespace without one of the
    declared flags is refused (a parser built by hand, or a flag renamed in one place only)."""
    given = vars(args)
    missing = [s.flag for s in FLAGS if s.name not in given]
    if missing:
        raise TypeError(f"skyrl-sdk serve: the flags {missing} are declared (server/settings.py) but the parsed "
                        f"arguments lack them: build serve's parser with settings.add_flags")
    return {s.name: given[s.name] for s in FLAGS}


def render_flags_table() -> str:
    """docs/server.md's flags table (between :data:`MARK_START` and :data:`MARK_END`)."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for s in FLAGS:
        assert s.flag is not None  # FLAGS: the settings with a flag
        name = f"`{s.flag}`, `--no-{s.flag[2:]}`" if s.switch else f"`{s.flag}{' ' + s.metavar if s.metavar else ''}`"
        lines.append(f"| {name} | {s.default_text} | {s.help} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    print(render_flags_table())
