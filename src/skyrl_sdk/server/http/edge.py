"""The connection edge: uvicorn (h11) with a header timeout, a connection cap, a quiet accept
loop at the file-descriptor limit, and a shutdown that answers clients first.

Why these and not uvicorn's options (0.54, measured): uvicorn has no header timeout (its
keep-alive timer starts only after a response and any received byte cancels it), so 1500
connections that each sent half a request line were all still open a minute later;
``limit_concurrency`` answers 503 only after parsing a request and counts those stalled
connections, which turns such a client into a denial of service for everyone (health checks
included); ``http="auto"`` picks httptools when installed, which has no header size limit. So
h11 is forced, with :class:`GuardedH11Protocol` (a subclass of uvicorn's, hence the upper
bound on uvicorn in pyproject.toml): a connection must send its request line and headers
within ``header_timeout_s`` of connecting or of its last answer, else it is dropped; one
answered before its body was read (the guard refuses at the headers) may send the rest of
it, discarded, for :data:`LINGER_S`, then is closed (uvicorn would drain it for as long as it
trickles in); beyond ``max_connections`` the oldest connection with no request in progress is
dropped to make room, else the one whose body has gone longest without a byte (16 bodies of
one byte each used to hold a 16-connection server until their 120 s deadline, resetting
every health check), and only with neither the new one. Hypercorn has header timeouts but no
connection cap and cost ~35% more per request here.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

#: connections when ``max_connections`` is not given: at most this, and half the fd limit
DEFAULT_MAX_CONNECTIONS = 1000
#: asyncio's message for an accept() that failed for lack of file descriptors
_ACCEPT_FAILED = "socket.accept() out of system resource"


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # pragma: no cover - not allowed here
            pass
    return soft


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return DEFAULT_MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(DEFAULT_MAX_CONNECTIONS,
                                                                                      soft // 2))


#: how long a connection answered before its request body was read (401, 413, an open path)
#: may go on sending that body, discarded, before it is closed
LINGER_S = 2.0


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout and a connection cap (module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        HEADER_TIMEOUT_S = header_timeout_s
        MAX_CONNECTIONS = max_connections
        #: this server's open connections, least recently served first (a connection moves to
        #: the end when a request head arrives and when it is answered; a dict: ordered, O(1))
        _open: dict[GuardedH11Protocol, None] = {}
        _rejected = False
        _timer: asyncio.TimerHandle | None = None
        #: what the armed timer waits for: "head" (a request line and headers) or "linger"
        _waiting: str | None = None
        #: loop time of the last bytes received (a stalled body is the first to go at the cap)
        _last_data = 0.0

        # ---- a connection's state -------------------------------------------------------------
        def _in_request(self) -> bool:
            """A request head arrived and its answer is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

        def _body_arriving(self) -> bool:
            """In a request whose body has not all arrived."""
            return self._in_request() and self.conn.their_state is h11.SEND_BODY

        def _retime(self) -> None:
            """Arm the timer the connection's state calls for: none in a request; the header
            timeout when idle; a short linger when answered before its body was read."""
            if self.transport.is_closing() or self._in_request():
                self._disarm()
            elif self.conn.their_state is h11.SEND_BODY:  # the rest of a body no one will read
                if self._waiting != "linger":
                    self._arm(LINGER_S, "linger")
            elif self._waiting != "head":
                self._arm(self.HEADER_TIMEOUT_S, "head")

        # ---- uvicorn's callbacks ----------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= self.MAX_CONNECTIONS:
                self._make_room()
            if len(self.connections) >= self.MAX_CONNECTIONS:
                self._rejected = True  # closed before anything is parsed; never counted
                transport.abort()
                return
            super().connection_made(transport)
            self._last_data = self.loop.time()
            self._open[self] = None
            self._retime()

        def _make_room(self) -> None:
            """Drop one connection: the least recently served one with no request in progress
            (one that never sent a whole request head, or is lingering, before one that keeps
            asking: least recent first, so usually the first one looked at), else the one whose
            request body has gone longest without a byte (a trickled body must not lock out
            new clients; a request whose body has arrived is never dropped)."""
            victim = next((c for c in self._open if not c._in_request()), None)
            if victim is None:
                readers = [c for c in self._open if c._body_arriving()]
                victim = min(readers, key=lambda c: c._last_data) if readers else None
            if victim is not None:
                del self._open[victim]
                victim._disarm()
                victim.transport.abort()
                self.connections.discard(victim)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._rejected:
                return
            self._open.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def eof_received(self) -> None:
            if not self._rejected:
                super().eof_received()

        def data_received(self, data: bytes) -> None:
            if self._rejected:
                return
            self._last_data = self.loop.time()
            was_in_request = self._in_request()
            super().data_received(data)
            if self._in_request() and not was_in_request:  # a whole head arrived
                self._served()
            self._retime()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._served()
                self._retime()  # the next request's head within the same time, or a short linger

        def _served(self) -> None:
            if self._open.pop(self, True) is None:
                self._open[self] = None

        def _arm(self, delay: float, waiting: str) -> None:
            self._disarm()
            self._waiting = waiting
            self._timer = self.loop.call_later(delay, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting = None, None

        def _timed_out(self) -> None:
            self._timer, self._waiting = None, None
            if not self._in_request() and not self.transport.is_closing():
                self.transport.abort()  # no request to answer; frees the fd at once

    return GuardedH11Protocol


def install_accept_log_limiter(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """At the fd limit asyncio logs a traceback for every failed accept(), up to the listen
    backlog per tick, every second (97 MB of log in 45 s was measured): log that one at most
    every ``every_s`` seconds, with a count of the ones left out; pass everything else on."""
    last, left_out = [float("-inf")], [0]
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            now = time.monotonic()
            if now - last[0] < every_s:
                left_out[0] += 1
                return
            last[0] = now
            logger.warning("accept() failed: %s (too many open files?); %d such failures not logged since the last "
                           "line", context.get("exception"), left_out[0])
            left_out[0] = 0
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)


class Server(uvicorn.Server):
    """uvicorn's server, with the accept-error log limited and, at the first Ctrl-C / SIGTERM,
    before connections are drained: the app's ``begin_shutdown()`` (fail what has not run,
    answering its long-polls) and ``settle()`` (wait for the running job, so its long-poll
    answers with what happened), so clients hear the truth instead of a dropped connection."""

    async def startup(self, sockets: Any = None) -> None:
        install_accept_log_limiter(asyncio.get_running_loop())
        await super().startup(sockets)

    async def shutdown(self, sockets: Any = None) -> None:
        begin = getattr(self.config.app, "begin_shutdown", None)
        if begin is not None:
            begin()
            settle = getattr(self.config.app, "settle", None)
            if settle is not None:
                await settle(lambda: self.force_exit)
            await asyncio.sleep(0.05)  # the woken long-polls answer
        await super().shutdown(sockets)


def server_config(app: Any, config: Any, **overrides: Any) -> uvicorn.Config:
    """The uvicorn config of ``app`` for a :class:`~.config.ServerConfig`: h11 with the guards
    above, keep-alive ``keep_alive_s``, a graceful drain of at most 3 s of ``shutdown_s``."""
    max_connections = config.max_connections or default_max_connections()
    options = dict(host=config.host, port=config.port, log_level="warning", lifespan="on",
                   http=guarded_protocol(config.header_timeout_s, max_connections),
                   timeout_keep_alive=config.keep_alive_s,
                   timeout_graceful_shutdown=min(3.0, config.shutdown_s / 2))
    return uvicorn.Config(app, **{**options, **overrides})
