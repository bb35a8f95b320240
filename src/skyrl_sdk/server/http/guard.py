"""ASGI middleware in front of every route: headers first, then the key, then the body.

In order, each answered by the guard itself before anything else runs:

- Request line and headers over :data:`MAX_HEADER_BYTES` (16 KiB): 431. (h11 limits only a
  head that arrives in pieces; a whole 64 KiB head in one read passed it.)
- ``/api/v1/healthz``: answered here, touching nothing (no route, no SQLite, no compute), so
  it answers however busy the rest is. Open paths never read a body.
- Without API keys: the ``Host`` / ``Origin`` / ``Content-Type`` checks of :mod:`.origins`
  (DNS rebinding, cross-site pages): 403 / 415.
- With API keys configured, a request without a known ``X-API-Key`` header gets 401 before
  its body is read (every key compared in constant time; ASGI header names arrive
  lower-cased, so any casing the client used matches). The console's page and files stay
  open. The key's owner is put in the ASGI scope (``OWNER_SCOPE_KEY``) for the routes, and a
  :class:`~.edge.Waiting` naming it (``WAITING_SCOPE_KEY``, in the scope uvicorn holds too) for
  the connection edge, which counts an owner's long-polls against its share of the connections.
- The body is read here, before any route runs, and handed on in the scope
  (``BODY_SCOPE_KEY``, no copy): larger than the route's cap (declared, sent, chunked, or
  after zstd) gets 413; a pause of more than ``body_idle_timeout_s`` between two pieces, or
  not all of it within ``body_timeout_s``, gets 408 (connection closed); when the bodies in
  flight over all connections would pass their byte budget, 503 (the client retries); a
  client that disconnects mid-body gets nothing and no route runs. The cap is
  ``max_body_bytes`` for the protobuf ``forward_backward`` and ``max_json_body_bytes`` for
  the JSON routes.
- ``Content-Encoding: zstd`` is accepted on ``forward_backward`` only, and only when the
  server asks clients to compress (``proto_compress_fwdbwd`` in its client config); it is
  decompressed off the event loop, capped while it streams (:mod:`.bodies`). Else 415.

Every answer, the guard's and the routes', carries ``X-Content-Type-Options: nosniff`` and
``Cache-Control: no-store`` (:data:`SECURITY_HEADERS`). A request answered before its body
was read leaves the rest of the body to the connection edge (:mod:`.edge`), which discards
it for a short while, then closes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from ..config import DEFAULT_OWNER
from ..wire.bodies import Bodies
from . import origins
from .edge import WAITING_SCOPE_KEY, Waiting

#: the console's page and its static files: they carry no data, so they need no key (what the
#: page shows comes from /console/api/*, behind the key like every other route)
CONSOLE_STATIC = frozenset({"/", "/console/console.js", "/console/charts.js", "/console/console.css"})
HEALTHZ = "/api/v1/healthz"
OPEN_PATHS = frozenset({HEALTHZ}) | CONSOLE_STATIC
#: signed download links: the unguessable, expiring token in the path is the credential
#: (the client fetches them with urllib, without its key; :mod:`.exports`)
OPEN_PREFIXES = ("/api/v1/downloads/",)
OWNER_SCOPE_KEY = "skyrl_sdk.owner"
#: the request body, read (and decompressed) by the guard
BODY_SCOPE_KEY = "skyrl_sdk.body"
#: the one route whose body is protobuf (and may be large, and compressed)
PROTOBUF_PATHS = frozenset({"/api/v1/forward_backward"})
#: request line + headers, as docs/server.md states (h11's own limit applies only to a head
#: that arrives in pieces)
MAX_HEADER_BYTES = 16 * 1024
#: on every answer: no content sniffing, nothing cached (answers hold an owner's data)
SECURITY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-store"))


async def _send_json(send: Any, status: int, obj: dict, extra_headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def _with_security_headers(send: Any) -> Any:
    async def secured(message: dict) -> None:
        if message["type"] == "http.response.start":
            have = {k.lower() for k, _ in message.get("headers", [])}
            extra = [(k, v) for k, v in SECURITY_HEADERS if k not in have]
            if extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return secured


def header_bytes(scope: dict) -> int:
    """Bytes of the request line and headers as sent (names, values, separators)."""
    line = len(scope.get("method", "")) + len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 12
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))


class _Gone(Exception):
    """The client disconnected before its whole body arrived: nothing to answer."""


class _Refused(Exception):
    """A body the guard answers itself (status, detail, extra headers)."""

    def __init__(self, status: int, detail: str, headers: list | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or []


def _is_open(path: str) -> bool:
    """Paths that need no key and take no body (health, the console's page, signed downloads)."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class Guard:
    def __init__(self, app: Any, owners: dict[str, str] | None, max_body_bytes: int, bodies: Bodies | None = None,
                 *, max_json_body_bytes: int | None = None, body_timeout_s: float | None = None,
                 body_idle_timeout_s: float | None = None, zstd: bool = False,
                 allowed_hosts: frozenset[str] | None = None) -> None:
        self.app = app
        self.owners = {k.encode(): v for k, v in owners.items()} if owners else None
        self.max_body_bytes = max_body_bytes
        self.max_json_body_bytes = min(max_json_body_bytes or max_body_bytes, max_body_bytes)
        self.bodies = bodies or Bodies(4 * max_body_bytes)
        self.body_timeout_s = body_timeout_s
        self.body_idle_timeout_s = body_idle_timeout_s
        self.zstd = zstd
        #: Host names a keyless server answers (None: any; see :mod:`.origins`)
        self.allowed_hosts = allowed_hosts

    def owner_of(self, given: bytes) -> str | None:
        """The owner of API key ``given`` (None if unknown); compares with every key."""
        found = None
        for key, owner in (self.owners or {}).items():  # a keyless server knows no key
            if hmac.compare_digest(given, key):
                found = owner
        return found

    def _at_the_headers(self, scope: dict, headers: dict[str, bytes]) -> tuple[int, str, list] | str:
        """Everything decided from the request line and headers: the owner, or an answer
        (status, detail, extra headers)."""
        path: str = scope.get("path") or ""
        method = scope.get("method", "GET")
        if header_bytes(scope) > MAX_HEADER_BYTES:
            return 431, f"request line and headers larger than {MAX_HEADER_BYTES} bytes", [(b"connection", b"close")]
        if path == HEALTHZ:
            if method in ("GET", "HEAD"):
                return 200, "", []
            return 405, "method not allowed", [(b"allow", b"GET")]
        owner = DEFAULT_OWNER
        if self.owners is None:
            refused = origins.refusal(method, path, headers, self.allowed_hosts, PROTOBUF_PATHS)
            if refused is not None:
                return (*refused, [])
        elif not _is_open(path):
            found = self.owner_of(headers.get("x-api-key", b""))
            if found is None:
                return 401, "missing or unknown X-API-Key", [(b"www-authenticate", b"X-API-Key")]
            owner = found
        return owner

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        owner = self._at_the_headers(scope, headers)
        if not isinstance(owner, str):
            status, detail, extra = owner
            await _send_json(send, status, {"status": "ok"} if status == 200 else {"detail": detail}, extra)
            return
        scope[WAITING_SCOPE_KEY] = Waiting(owner)  # what the edge may know of this request (its owner)
        held = [0]  # bytes of this request counted in the in-flight budget
        try:
            if _is_open(scope.get("path") or ""):  # no data, no body: whatever was sent is never read
                body, new_headers = b"", scope.get("headers", [])
            else:
                body, new_headers = await self._body(scope, headers, receive, held)
        except _Refused as r:
            self.bodies.release(held[0])
            await _send_json(send, r.status, {"detail": r.detail}, r.headers)
            return
        except _Gone:
            self.bodies.release(held[0])
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app({**scope, "headers": new_headers, OWNER_SCOPE_KEY: owner, BODY_SCOPE_KEY: body},
                           replay, send)
        finally:
            self.bodies.release(held[0])

    async def _body(self, scope: dict, headers: dict, receive: Any, held: list) -> tuple[bytes, list]:
        """The request's body (decompressed) and headers to pass on; :class:`_Refused` otherwise."""
        protobuf = scope.get("path") in PROTOBUF_PATHS
        cap = self.max_body_bytes if protobuf else self.max_json_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise _Refused(413, f"request body larger than {cap} bytes")
        zstd = headers.get("content-encoding", b"").strip().lower() == b"zstd"
        if zstd and not (protobuf and self.zstd):
            raise _Refused(415, "Content-Encoding: zstd is accepted only on forward_backward, and only when this "
                                "server asks for it (proto_compress_fwdbwd in its client config)")
        try:
            body = await asyncio.wait_for(self._read(receive, cap, held), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise _Refused(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           [(b"connection", b"close")]) from None
        new_headers = scope.get("headers", [])
        if zstd:
            import zstandard

            try:
                out = await self.bodies.unzstd(body, cap)
            except zstandard.ZstdError as exc:
                raise _Refused(400, f"body is not valid zstd: {exc}") from None
            if out is None:
                raise _Refused(413, f"request body larger than {cap} bytes after zstd")
            self._hold(len(out), held)
            body = out
            new_headers = [(k, v) for k, v in new_headers if k.lower() not in (b"content-encoding", b"content-length")]
            new_headers.append((b"content-length", str(len(body)).encode()))
        return body, new_headers

    async def _read(self, receive: Any, cap: int, held: list) -> bytes:
        """The whole body; :class:`_Refused` once more than ``cap`` bytes arrived or when it
        pauses longer than ``body_idle_timeout_s`` (nginx's ``client_body_timeout``: a body that
        trickles in holds a connection, which the edge needs for others), :class:`_Gone` when
        the client went away."""
        chunks, total = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_idle_timeout_s)
            except asyncio.TimeoutError:
                raise _Refused(408, f"the request body paused for more than {self.body_idle_timeout_s:g} s",
                               [(b"connection", b"close")]) from None
            if message["type"] != "http.request":
                raise _Gone
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > cap:
                raise _Refused(413, f"request body larger than {cap} bytes")
            self._hold(len(chunk), held)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _hold(self, n: int, held: list) -> None:
        if not self.bodies.reserve(n):
            raise _Refused(503, "the server is reading too many request bodies at once; retry shortly",
                           [(b"retry-after", b"1")])
        held[0] += n
