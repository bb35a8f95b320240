"""The connection edge: uvicorn (h11) with a header timeout, a write deadline, a bound on
pipelined requests, a connection cap that always makes room for a newcomer while anyone
holds a connection idly, a quiet accept loop at the file-descriptor limit, and a shutdown
that answers clients first.

Why these and not uvicorn's options (0.54, measured): uvicorn has no header timeout (its
keep-alive timer starts only after a response and any received byte cancels it), so 1500
connections that each sent half a request line were all still open a minute later;
``limit_concurrency`` answers 503 only after parsing a request and counts those stalled
connections, which turns such a client into a denial of service for everyone (health checks
included); ``http="auto"`` picks httptools when installed, which has no header size limit. So
h11 is forced, with :class:`GuardedH11Protocol` (a subclass of uvicorn's, hence the upper
bound on uvicorn in pyproject.toml):

- a connection must send its request line and headers within ``header_timeout_s`` of
  connecting or of its last answer, else it is dropped; one answered before its body was read
  (the guard refuses at the headers) may send the rest of it, discarded, for :data:`LINGER_S`;
- a request the client sent before taking the previous answer (pipelined) waits until it has
  (the answer acknowledged: the kernel's send queue, SIOCOUTQ, is empty): a client that does
  not read gets one answer computed, not as many as the kernel would buffer (megabytes: 1010
  such connections, 400 requests each, kept the server busy for a minute and a half);
- an answer the client does not read (the transport's buffer stays over its high-water mark)
  is given ``send_timeout_s`` (nginx's ``send_timeout``), then the connection is dropped: 16
  connections that each sent 400 pipelined requests in one write and never read used to hold
  a 16-connection server forever;
- after ``max_pipelined`` requests a client sent before reading the answers, the connection is
  closed after the next answer (the rest of what it sent is dropped);
- beyond ``max_connections`` one connection makes room for the newcomer, the first of: the
  least recently served with no request in progress; the one whose answer has gone unread
  longest; the one whose request body has gone longest without a byte (16 bodies of one byte
  each used to hold a 16-connection server until their 120 s deadline); a long-poll of the
  owner holding the most, when it holds more than its share (a quarter of the cap) or
  long-polls hold all but the headroom (an eighth of the cap) of the connections: that
  long-poll is answered at once (429, ``Retry-After``, then closed), so one owner's waiting
  requests never lock out ``/healthz`` or other owners (they count against its share, not the
  whole cap). Only when every connection is busy otherwise is the newcomer turned away.

The edge learns a request's owner, and how to end its long-poll, from a :class:`Waiting` the
guard puts in the request's scope (:data:`WAITING_SCOPE_KEY`). Hypercorn has header timeouts
but no connection cap and cost ~35% more per request here.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import struct
import sys
import termios
import time
from collections.abc import Callable
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
#: the ASGI scope key of a request's :class:`Waiting`
WAITING_SCOPE_KEY = "skyrl_sdk.waiting"


class Waiting:
    """What the edge knows of a request in progress: its ``owner`` (set by the guard), and while
    it waits for a result (a long-poll: ``since``, loop time), ``wake()`` to make it answer now."""

    __slots__ = ("owner", "wake", "since")

    def __init__(self, owner: str | None = None) -> None:
        self.owner = owner
        self.wake: Callable[[], None] | None = None
        self.since = 0.0


#: how soon a connection held for its client to take an answer is first looked at again
HOLD_CHECK_S = 0.01
#: Linux's ioctl for a socket's unsent and unacknowledged bytes (SIOCOUTQ); None elsewhere
_OUTQ = getattr(termios, "TIOCOUTQ", None) if sys.platform.startswith("linux") else None


def untaken_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` that the client has not taken: in the transport's buffer
    and, on Linux, in the kernel's send queue (sent but not acknowledged: the client's receive
    window is full, it is not reading). Elsewhere only the transport's buffer."""
    pending = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if pending or _OUTQ is None or sock is None:
        return pending
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def guarded_protocol(header_timeout_s: float, max_connections: int, send_timeout_s: float = 30.0,
                     max_pipelined: int = 32) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the edge's timeouts and connection accounting (module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        HEADER_TIMEOUT_S = header_timeout_s
        SEND_TIMEOUT_S = send_timeout_s
        MAX_PIPELINED = max_pipelined
        MAX_CONNECTIONS = max_connections
        #: long-polls of one owner beyond which one of them makes room for a newcomer
        LONG_POLL_SHARE = max(1, max_connections // 4)
        #: connections long-polls may not hold all of (beyond it one of them makes room)
        HEADROOM = max(1, max_connections // 8)
        #: this server's open connections, least recently served first (a connection moves to
        #: the end when a request head arrives and when it is answered; a dict: ordered, O(1))
        _open: dict[GuardedH11Protocol, None] = {}
        _rejected = False
        _timer: asyncio.TimerHandle | None = None
        #: what the armed timer waits for: "head" (a request line and headers), "linger", or
        #: "flush" (a closing connection's last answer to be read)
        _waiting: str | None = None
        #: loop time of the last bytes received (a stalled body is the first to go at the cap)
        _last_data = 0.0
        #: loop time the transport's buffer went over its high-water mark (None: below it)
        _write_paused_at: float | None = None
        _write_timer: asyncio.TimerHandle | None = None
        #: requests in a row that had arrived before the answer to the previous one was sent
        _pipelined = 0
        #: answered, but the client has not taken the answer: the next request waits for it
        _held = False
        _hold_timer: asyncio.TimerHandle | None = None

        # ---- a connection's state -------------------------------------------------------------
        def _in_request(self) -> bool:
            """A request head arrived and its answer is not complete."""
            return self.cycle is not None and not self.cycle.response_complete

        def _body_arriving(self) -> bool:
            """In a request whose body has not all arrived."""
            return self._in_request() and self.conn.their_state is h11.SEND_BODY

        def _long_poll(self) -> Waiting | None:
            """The request's :class:`Waiting` while it waits for a result (a long-poll), else None."""
            waiting = self.scope.get(WAITING_SCOPE_KEY) if self._in_request() and self.scope else None
            return waiting if isinstance(waiting, Waiting) and waiting.wake is not None else None

        def _retime(self) -> None:
            """Arm the timer the connection's state calls for: none in a request; the header
            timeout when idle; a short linger when answered before its body was read."""
            if self.transport.is_closing():
                if self._waiting != "flush":
                    self._disarm()
            elif self._in_request():
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
            """Make room for a newcomer: drop (or, a long-poll, answer at once) the first
            connection of the module docstring's order, if any."""
            victim = next((c for c in self._open if not c._in_request()), None)
            if victim is None:
                unread = {c: c._write_paused_at for c in self._open if c._write_paused_at is not None}
                victim = min(unread, key=unread.__getitem__) if unread else None
            if victim is None:
                readers = [c for c in self._open if c._body_arriving()]
                victim = min(readers, key=lambda c: c._last_data) if readers else None
            if victim is not None:
                del self._open[victim]
                victim._drop()
                self.connections.discard(victim)
                return
            self._end_a_long_poll()

        def _end_a_long_poll(self) -> None:
            """Answer at once the oldest long-poll of the owner holding the most, when that owner
            holds more than its share or long-polls hold all but the headroom; it closes after
            that answer and counts no more."""
            polls: dict[str | None, list[tuple[Waiting, GuardedH11Protocol]]] = {}
            for c in self._open:
                if (waiting := c._long_poll()) is not None:
                    polls.setdefault(waiting.owner, []).append((waiting, c))
            if not polls:
                return
            mine = max(polls.values(), key=len)
            if len(mine) <= self.LONG_POLL_SHARE and sum(map(len, polls.values())) <= \
                    self.MAX_CONNECTIONS - self.HEADROOM:
                return
            oldest, victim = min(mine, key=lambda pair: pair[0].since)
            wake = oldest.wake
            assert wake is not None  # a long-poll's (see _long_poll)
            victim.cycle.keep_alive = False  # closed after its answer
            del self._open[victim]
            self.connections.discard(victim)
            wake()

        def _drop(self) -> None:
            self._held = False
            self._disarm()
            self._disarm_write()
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._rejected:
                return
            self._open.pop(self, None)
            self._held = False
            self._disarm()
            self._disarm_write()
            super().connection_lost(exc)

        def eof_received(self) -> None:
            if not self._rejected:
                super().eof_received()

        def data_received(self, data: bytes) -> None:
            if self._rejected:
                return
            self._last_data = self.loop.time()
            if self._held and not untaken_bytes(self.transport):  # (the request carries the answer's ack)
                self._next_request()
            was_in_request = self._in_request()
            super().data_received(data)
            if self._in_request() and not was_in_request:  # a whole head arrived
                self._pipelined = 0
                self._served()
            self._retime()

        def on_response_complete(self) -> None:
            """uvicorn's, except that a request the client sent before taking this answer waits
            until it has (h11's backpressure, which uvicorn applies only past its own buffer's
            high-water mark, after computing answers the kernel then holds by the megabyte)."""
            self.server_state.total_requests += 1
            if self.transport.is_closing():  # closing once the answer is sent: the client must read it
                if self.transport.get_write_buffer_size() and self._waiting != "flush":
                    self._arm(self.SEND_TIMEOUT_S, "flush")
                return
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            self._served()
            self._held = True
            self._check_taken(HOLD_CHECK_S)

        def _check_taken(self, delay: float) -> None:
            """(held) Go on with the next request once the client has taken the answer, else look
            again in ``delay`` s (doubling: a client that never reads costs little)."""
            self._hold_timer = None
            if not self._held or self.transport.is_closing():
                return
            if not untaken_bytes(self.transport):
                self._next_request()
                return
            self._retime()
            self._hold_timer = self.loop.call_later(delay, self._check_taken, min(2 * delay, 1.0))

        def _next_request(self) -> None:
            """Read on, and start the request that arrived meanwhile (pipelined), if any."""
            answered, self._held = self.cycle, False
            if self._hold_timer is not None:
                self._hold_timer.cancel()
                self._hold_timer = None
            self.flow.resume_reading()
            if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                self.conn.start_next_cycle()
                self.handle_events()
            if self.cycle is not answered and self._in_request():  # the next request had already arrived
                self._pipelined += 1
                if self._pipelined >= self.MAX_PIPELINED:
                    self.cycle.keep_alive = False  # answer this one, then close: the rest is dropped
                self._served()
            self._retime()  # the next request's head within the same time, or a short linger

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_paused_at is None:
                self._write_paused_at = self.loop.time()
                self._write_timer = self.loop.call_later(self.SEND_TIMEOUT_S, self._unread)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm_write()

        def _unread(self) -> None:
            """The client has not read the answer for ``SEND_TIMEOUT_S``: drop the connection."""
            self._write_timer = None
            self._open.pop(self, None)
            self._drop()

        def _disarm_write(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
            self._write_timer, self._write_paused_at = None, None

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
            waited, self._timer, self._waiting = self._waiting, None, None
            if waited == "flush" or (not self._in_request() and not self.transport.is_closing()):
                self.transport.abort()  # no request to answer (or a last answer never read); frees the fd

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
                   http=guarded_protocol(config.header_timeout_s, max_connections, config.send_timeout_s,
                                         config.max_pipelined_requests),
                   timeout_keep_alive=config.keep_alive_s,
                   timeout_graceful_shutdown=min(3.0, config.shutdown_s / 2))
    return uvicorn.Config(app, **{**options, **overrides})
