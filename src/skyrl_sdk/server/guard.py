"""ASGI middleware in front of every route: API key, body size limit, zstd bodies.

- With an API key configured, a request without the right ``X-API-Key`` header gets 401
  (constant-time comparison; ASGI header names arrive lower-cased, so any casing the
  client used matches). ``GET /api/v1/healthz`` stays open for health checks.
- A body larger than ``max_body_bytes`` (declared or actually sent) gets 413.
- ``Content-Encoding: zstd`` bodies (the client compresses forward_backward when the
  server's client config asks it to) are decompressed within the same limit.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

OPEN_PATHS = frozenset({"/api/v1/healthz"})


class BodyTooLarge(Exception):
    pass


async def _send_json(send: Any, status: int, obj: dict, extra_headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get("x-api-key", b"")
            if not hmac.compare_digest(given, self.api_key):
                await _send_json(send, 401, {"detail": "missing or wrong X-API-Key"},
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
        if headers.get("content-encoding", b"").strip().lower() == b"zstd":
            await self._zstd(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        await _send_json(send, 413, {"detail": f"request body larger than {self.max_body_bytes} bytes"})

    async def _zstd(self, scope: dict, receive: Any, send: Any) -> None:
        import zstandard

        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        out = bytearray()
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(b"".join(chunks))
            while piece := reader.read(1 << 20):
                out += piece
                if len(out) > self.max_body_bytes:
                    await self._too_large(send)
                    return
        except zstandard.ZstdError as exc:
            await _send_json(send, 400, {"detail": f"body is not valid zstd: {exc}"})
            return
        body = bytes(out)
        new_headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")]
        new_headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": new_headers}, replay, send)
