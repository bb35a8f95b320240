"""ASGI middleware in front of every route: API key -> owner, body size limit, zstd bodies.

- With API keys configured, a request without a known ``X-API-Key`` header gets 401
  (every key compared in constant time; ASGI header names arrive lower-cased, so any
  casing the client used matches). ``GET /api/v1/healthz`` stays open for health checks.
  The key's owner is put in the ASGI scope (``OWNER_SCOPE_KEY``) for the routes.
- The body is read here, before any route runs: larger than ``max_body_bytes`` (declared
  or actually sent, chunked included) gets 413.
- ``Content-Encoding: zstd`` bodies (the client compresses forward_backward when the
  server's client config asks it to) are decompressed within the same limit.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from .config import DEFAULT_OWNER

#: the console's page and its static files: they carry no data, so they need no key (what the
#: page shows comes from /console/api/*, behind the key like every other route)
CONSOLE_STATIC = frozenset({"/", "/console/console.js", "/console/console.css"})
OPEN_PATHS = frozenset({"/api/v1/healthz"}) | CONSOLE_STATIC
OWNER_SCOPE_KEY = "skyrl_sdk.owner"


async def _send_json(send: Any, status: int, obj: dict, extra_headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Any, owners: dict[str, str] | None, max_body_bytes: int) -> None:
        self.app = app
        self.owners = {k.encode(): v for k, v in owners.items()} if owners else None
        self.max_body_bytes = max_body_bytes

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
        if self.owners is not None and scope.get("path") not in OPEN_PATHS:
            owner = self.owner_of(headers.get("x-api-key", b""))
            if owner is None:
                await _send_json(send, 401, {"detail": "missing or unknown X-API-Key"},
                                 [(b"www-authenticate", b"X-API-Key")])
                return
        declared = headers.get("content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._too_large(send)
                return
        body = await self._read_body(receive)
        if body is None:
            await self._too_large(send)
            return
        new_headers = scope.get("headers", [])
        if headers.get("content-encoding", b"").strip().lower() == b"zstd":
            body = await self._unzstd(body, send)
            if body is None:
                return
            new_headers = [(k, v) for k, v in new_headers if k.lower() not in (b"content-encoding", b"content-length")]
            new_headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": new_headers, OWNER_SCOPE_KEY: owner}, replay, send)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body, or None once more than ``max_body_bytes`` arrived."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _too_large(self, send: Any) -> None:
        await _send_json(send, 413, {"detail": f"request body larger than {self.max_body_bytes} bytes"})

    async def _unzstd(self, data: bytes, send: Any) -> bytes | None:
        import zstandard

        out = bytearray()
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(data)
            while piece := reader.read(1 << 20):
                out += piece
                if len(out) > self.max_body_bytes:
                    await self._too_large(send)
                    return None
        except zstandard.ZstdError as exc:
            await _send_json(send, 400, {"detail": f"body is not valid zstd: {exc}"})
            return None
        return bytes(out)
