"""ASGI middleware in front of every route: API key -> owner, body limits, zstd bodies.

- With API keys configured, a request without a known ``X-API-Key`` header gets 401
  (every key compared in constant time; ASGI header names arrive lower-cased, so any
  casing the client used matches). ``GET /api/v1/healthz`` stays open for health checks.
  The key's owner is put in the ASGI scope (``OWNER_SCOPE_KEY``) for the routes.
- The body is read here, before any route runs, and handed on in the scope
  (``BODY_SCOPE_KEY``, no copy): larger than the route's cap (declared, sent, chunked, or
  after zstd) gets 413; not all of it within ``body_timeout_s`` gets 408; when the bodies
  in flight over all connections would pass their byte budget, 503 (the client retries).
  The cap is ``max_body_bytes`` for the protobuf ``forward_backward`` and
  ``max_json_body_bytes`` for the JSON routes.
- ``Content-Encoding: zstd`` is accepted on ``forward_backward`` only, and only when the
  server asks clients to compress (``proto_compress_fwdbwd`` in its client config); it is
  decompressed off the event loop, capped while it streams (:mod:`.bodies`). Else 415.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from .bodies import Bodies
from .config import DEFAULT_OWNER

#: the console's page and its static files: they carry no data, so they need no key (what the
#: page shows comes from /console/api/*, behind the key like every other route)
CONSOLE_STATIC = frozenset({"/", "/console/console.js", "/console/console.css"})
OPEN_PATHS = frozenset({"/api/v1/healthz"}) | CONSOLE_STATIC
#: signed download links: the unguessable, expiring token in the path is the credential
#: (the client fetches them with urllib, without its key; :mod:`.exports`)
OPEN_PREFIXES = ("/api/v1/downloads/",)
OWNER_SCOPE_KEY = "skyrl_sdk.owner"
#: the request body, read (and decompressed) by the guard
BODY_SCOPE_KEY = "skyrl_sdk.body"
#: the one route whose body is protobuf (and may be large, and compressed)
PROTOBUF_PATHS = frozenset({"/api/v1/forward_backward"})


async def _send_json(send: Any, status: int, obj: dict, extra_headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class _Refused(Exception):
    """A body the guard answers itself (status, detail, extra headers)."""

    def __init__(self, status: int, detail: str, headers: list | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or []


class Guard:
    def __init__(self, app: Any, owners: dict[str, str] | None, max_body_bytes: int, bodies: Bodies | None = None,
                 *, max_json_body_bytes: int | None = None, body_timeout_s: float | None = None,
                 zstd: bool = False) -> None:
        self.app = app
        self.owners = {k.encode(): v for k, v in owners.items()} if owners else None
        self.max_body_bytes = max_body_bytes
        self.max_json_body_bytes = min(max_json_body_bytes or max_body_bytes, max_body_bytes)
        self.bodies = bodies or Bodies(4 * max_body_bytes)
        self.body_timeout_s = body_timeout_s
        self.zstd = zstd

    def owner_of(self, given: bytes) -> str | None:
        """The owner of API key ``given`` (None if unknown); compares with every key."""
        found = None
        for key, owner in self.owners.items():
            if hmac.compare_digest(given, key):
                found = owner
        return found

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        owner = DEFAULT_OWNER
        path = scope.get("path") or ""
        if self.owners is not None and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            owner = self.owner_of(headers.get("x-api-key", b""))
            if owner is None:
                await _send_json(send, 401, {"detail": "missing or unknown X-API-Key"},
                                 [(b"www-authenticate", b"X-API-Key")])
                return
        held = [0]  # bytes of this request counted in the in-flight budget
        try:
            body, new_headers = await self._body(scope, headers, receive, held)
        except _Refused as r:
            self.bodies.release(held[0])
            await _send_json(send, r.status, {"detail": r.detail}, r.headers)
            return
        sent = False

        async def replay():
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
        """The whole body; :class:`_Refused` once more than ``cap`` bytes arrived."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
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
