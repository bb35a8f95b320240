"""``skyrl-sdk serve``: check everything a client will need, bind, then say how to connect.

The server itself creates a Backend only when a client asks for a model, so a wrong
``--model``, ``--engine``, ``--sampler`` or their configs would otherwise surface minutes later
as a failed ``create_model`` or ``sample``. Here they are checked first, and the state dir is
locked for this server and written once (docs/server.md, "State dir"); a problem exits with
status 2 and one ``cannot start: ...`` line; the banner is printed once the port is bound. An
abnormal end (a fatal signal, an exception that ends the server or a thread) leaves a line in
the log.

It says what it is doing from its first moment: a line before anything heavy is imported, the
port checked at once (a busy one is refused before torch loads), a line per model it loads
and how long that took, and the time to ready in the banner. This module imports nothing
heavy itself: the HTTP app (fastapi, uvicorn, torch) is imported after the first checks.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InputError, SkyrlError, install_hint
from ..server.config import API_KEY_ENV, ServerConfig, is_loopback
from ..server.state.statedir import StateDirLock, check_writable
from .threads import apply as apply_threads

logger = logging.getLogger(__name__)

EXIT_BAD_CONFIG = 2
#: the server ended by an exception (logged as critical)
EXIT_FATAL = 3


class CannotServe(SkyrlError, ValueError):
    """A served model, the engine, the sampler or a config fails the start-up check."""


def say(message: str) -> None:
    """A start-up line on stderr, at once (stdout is for the caller's pipes)."""
    print(f"skyrl-sdk serve: {message}", file=sys.stderr, flush=True)


def server_modules() -> tuple[Any, Callable[..., Any]]:
    """The HTTP edge and ``create_app`` (the ``server`` extra: fastapi, uvicorn), imported once the
    cheap checks passed; a missing extra is refused naming the module and what to install."""
    try:
        from ..server.http import edge
        from ..server.http.app import create_app
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("skyrl_sdk"):
            raise
        raise CannotServe(f"cannot import {exc.name!r} ({install_hint('server')})") from None
    return edge, create_app
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def check_engine(engine: str) -> None:
    """The engine is registered (a plugin engine needs its package installed)."""
    from ..builtin_plugins import get_registry

    try:
        get_registry().engine_spec(engine)
    except InputError as exc:
        raise InputError(f"--engine: {exc}") from None


def check_sampler(sampler: str) -> None:
    """The sampler is registered (a plugin sampler needs its package installed)."""
    from ..builtin_plugins import get_registry

    try:
        get_registry().sampler_spec(sampler)
    except InputError as exc:
        raise InputError(f"--sampler: {exc}") from None


def check_port(host: str, port: int) -> None:
    """The port is a TCP port (0: a free one, picked when the server binds) and ``host:port``
    can be bound now (uvicorn binds it after the slower checks; a port in use or out of range
    would otherwise end in its traceback)."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port: expected a TCP port from 1 to 65535, or 0 for a free one, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        busy = "; another server may hold it: another --port, or --port 0 for a free one" \
            if exc.errno == errno.EADDRINUSE else ""
        raise InputError(f"--host/--port: cannot bind {host}:{port}: {(exc.strerror or str(exc)).lower()}{busy}") \
            from None


def check_model_files(model: str) -> None:
    """Without loading weights: ``tiny``, or a directory whose config transformers reads and that has weights."""
    from ..models.loading import load_config

    load_config(model)
    if model != "tiny" and not any(any(Path(model).expanduser().glob(p)) for p in _WEIGHT_PATTERNS):
        raise InputError(f"model {model!r}: directory has no weights (*.safetensors or *.bin)")


def trial_backend(model: str, config: Any) -> str:
    """Build one Backend as the server will, sample one token (a sampler checks its config when
    it is built), close it. Returns the sampler's ``describe()`` line."""
    from ..backend import Backend

    with Backend(model=model, engine=config.engine, engine_config=config.engine_config, sampler=config.sampler,
                 sampler_config=config.sampler_config) as backend:
        backend.sample([[0]], {"max_tokens": 1})
        assert backend.sampler is not None  # built by the sample above
        return backend.sampler.describe()


def preflight(config: Any, lazy: bool, progress: Callable[[str], None] | None = None) -> str:
    """Raise :class:`CannotServe` naming the first problem; cheap checks run first. Returns
    what the sampler says of itself, for the log.

    Without ``lazy`` every model is loaded once with the engine (and a plugin sampler samples a
    token from it). With ``lazy`` the engine, the sampler and their configs are tried on the
    built-in ``tiny`` model instead, and the served models' files are only inspected, so a big
    model's weights load once, when a client asks. ``progress`` hears a line per model loaded.
    """
    try:
        check_engine(config.engine)
        check_sampler(config.sampler)
        for model in config.models:
            check_model_files(model)
    except SkyrlError as exc:
        raise CannotServe(str(exc)) from None
    said = config.sampler
    for model in ("tiny",) if lazy else config.models:
        started = time.monotonic()
        if progress is not None:
            why = " (--lazy: the engine and sampler on tiny; the served models load when a client asks)" if lazy else ""
            progress(f"loading {model} on engine {config.engine} and sampling a token with {config.sampler}{why} ...")
        try:
            said = trial_backend(model, config)
        except Exception as exc:  # whatever stops a Backend now would stop the first client later
            where = (f"engine {config.engine!r} and sampler {config.sampler!r} with these configs" if lazy
                     else f"model {model!r} on engine {config.engine!r} with sampler {config.sampler!r}")
            raise CannotServe(f"{where}: {type(exc).__name__}: {exc}") from None
        if progress is not None:
            progress(f"{model} ready ({time.monotonic() - started:.1f} s)")
    return said


def client_hint(url: str, api_key: str | None, key_from_env: bool = False, keys_file: str | None = None) -> str:
    """How to point the tinker client at ``url``: lines a user can copy as they are, naming the
    key this server will accept (never printing a key itself)."""
    if keys_file:
        key = "<a key from " + keys_file + (" or the --api-key>" if api_key else ">")
        note = "this server checks keys (--api-keys): use yours"
    elif api_key and key_from_env:
        key, note = "$SKYRL_SDK_API_KEY", "the key this server was given"
    elif api_key:
        key, note = "<the key given to --api-key>", "this server checks it"
    else:
        key, note = "tml-local", "tml-<anything>: the client insists on the prefix; this server checks no key"
    return (f"  point the tinker client here:\n"
            f"    export TINKER_BASE_URL={url} TINKER_API_KEY={key}   # {note}\n"
            f"    or in Python: tinker.ServiceClient(base_url=\"{url}\", api_key=...)\n"
            f"    without network, also export HF_HUB_OFFLINE=1: the tokenizers this server names are local "
            f"directories; any other name (base_model=\"tiny\" typed by hand) then fails at once instead of after "
            f"~50 s of model-hub retries")


def console_hint(url: str, needs_key: bool) -> str:
    """Where the browser console is (docs/server.md, "Console"); the key is never printed."""
    if not needs_key:
        return f"  console in a browser: {url}/"
    return (f"  console in a browser: {url}/ (type an API key there, or open {url}/#key=<key>: "
            f"the part after # never reaches the server, but the browser keeps the link, key and all, "
            f"in its history)")


def bound_port(server: Any) -> int | None:
    """The port a started uvicorn server listens on (the one the system picked for ``--port 0``)."""
    for listener in getattr(server, "servers", ()):
        for sock in listener.sockets or ():
            return int(sock.getsockname()[1])
    return None


def banner(config: Any, key_from_env: bool = False, keys_file: str | None = None, port: int | None = None,
           sampler: str | None = None, ready_s: float | None = None) -> str:
    """What ``serve`` prints once bound; ``port`` is the bound one (default ``config.port``);
    ``sampler``: what the sampler said of itself at the start-up check (its ``describe()``),
    else its name; ``ready_s``: seconds from the command's start."""
    port = config.port if port is None else port
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"http://{host}:{port}"
    ready = f"ready in {ready_s:.1f} s; " if ready_s is not None else ""
    return (f"skyrl-sdk serve: listening on http://{config.host}:{port} "
            f"({ready}models: {', '.join(config.models)}; engine: {config.engine}; "
            f"sampler: {sampler or config.sampler}; state: {config.state_dir})\n"
            f"{client_hint(url, config.api_key, key_from_env, keys_file)}\n"
            f"{console_hint(url, config.owners() is not None)}\n  Ctrl-C stops it.")


def claim_state_dir(config: Any) -> StateDirLock:
    """Lock the state dir for this server's life (a second server on it is refused, naming this
    one) and check that it can be written (a full disk or a read-only directory is refused now,
    not answered with a 500 on every write later). A refused start leaves no directory it made."""
    root = Path(config.state_dir).expanduser().resolve()
    existed = root.exists()
    lock = StateDirLock.acquire(root, holder=f"skyrl-sdk serve on {config.host}:{config.port}")
    try:
        check_writable(lock.root)
    except BaseException:
        lock.release()
        if not existed:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return lock


def install_crash_reports() -> None:
    """An abnormal end leaves a line in the log: a fatal signal (SIGSEGV, SIGBUS from a file
    mapping that cannot grow, SIGABRT) dumps every thread's Python stack (``faulthandler``), and
    an exception that ends a thread is logged as critical instead of printed bare."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured)
        if sys.__stderr__ is not None:
            faulthandler.enable(file=sys.__stderr__, all_threads=True)

    def thread_died(hook_args: Any) -> None:
        if hook_args.exc_type is SystemExit:
            return
        logger.critical("fatal: thread %s ended with %s: %s", getattr(hook_args.thread, "name", "?"),
                        hook_args.exc_type.__name__, hook_args.exc_value,
                        exc_info=(hook_args.exc_type, hook_args.exc_value, hook_args.exc_traceback))

    threading.excepthook = thread_died


def serve(args: Any) -> int:
    """The ``serve`` subcommand: validate, bind, announce, run until Ctrl-C / SIGTERM."""
    started = time.monotonic()
    host, port = args.host, args.port
    say(f"starting on {host}:{port} (models: {', '.join(args.models or ['tiny'])}; engine: {args.engine}; "
        f"sampler: {args.sampler}): checking the port, then loading each model once ...")
    try:
        check_port(host, port)
        config = ServerConfig.from_args(args)
        say("the port is free; importing torch, transformers and the HTTP server ...")
        edge, create_app = server_modules()
        sampler = preflight(config, lazy=args.lazy, progress=say)
        state_lock = claim_state_dir(config)
    except SkyrlError as exc:
        print(f"skyrl-sdk serve: cannot start: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    logger.info("torch uses %s", apply_threads(args.threads))
    if not is_loopback(config.host) and not config.owners():
        logger.warning("serving on %s without an API key: anyone who can reach it can train and read "
                       "checkpoints (pass --api-key or set SKYRL_SDK_API_KEY)", config.host)
    env_key = os.environ.get(API_KEY_ENV)
    key_from_env = bool(env_key) and config.api_key == env_key
    keys_file = args.api_keys
    edge.raise_fd_limit()
    app = create_app(config, state_lock)

    # edge is imported late (the server extra): a base class mypy cannot resolve
    class AnnouncingServer(edge.Server):  # type: ignore[name-defined]
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # bound and listening; a failed bind has exited already
                print(banner(config, key_from_env, keys_file, bound_port(self), sampler,
                             time.monotonic() - started), file=sys.stderr, flush=True)

    server = AnnouncingServer(edge.server_config(app, config))
    install_crash_reports()
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down
        pass
    except SystemExit as exc:  # uvicorn's own exit (a failed start-up: its reason is logged above)
        logger.critical("fatal: the server stopped (exit status %s)", exc.code)
        raise
    except BaseException as exc:  # whatever ends the server otherwise ends it with a line saying so
        logger.critical("fatal: the server stopped: %s: %s", type(exc).__name__, exc, exc_info=True)
        logging.shutdown()
        os._exit(EXIT_FATAL)
    if not server.started:
        return 1
    # Leave without the interpreter's teardown: after the shutdown every Backend is closed and
    # SQLite has committed, while tearing down torch and transformers takes seconds (4 s measured
    # on a busy 2-core machine), and a job still running torch on the daemon compute thread
    # (runtime.left_running, or a second Ctrl-C) can make that teardown abort the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
