"""Request bodies off the event loop: zstd decompression capped while it streams, parsing, and
a byte budget for the bodies being read at once.

Why: the event loop answers every client (health checks and long-polls included), and a
16.8 KB zstd body that inflates to 200 MB of JSON, decompressed and parsed on the loop,
stalled every other request for 4.6 s (six at once: 1.2 GB). Here a body over
:data:`SMALL_BODY` is decompressed and parsed on one pool thread, and decompression stops as
soon as its output passes the route's cap. One thread, because parsers hold the GIL for a
whole body (the event loop then waits for that parse, never for two in a row: with two
threads six 7 MB JSON bodies stalled it 0.67 s, so a second thread would only add a malloc
arena), while zstd releases it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: bodies up to this size are parsed on the event loop (a thread hand-off costs more)
SMALL_BODY = 64 * 1024
#: threads that decompress and parse bodies (see the module docstring)
POOL_THREADS = 1
#: decompressed bytes read per step (the cap is checked after each)
_PIECE = 1 << 20


def unzstd_capped(data: bytes, cap: int) -> bytes | None:
    """``data`` decompressed, or None once more than ``cap`` bytes came out (or its frame header
    declares more: refused before anything is inflated). Raises ``zstandard.ZstdError`` for a
    body that is not zstd.

    Streamed in pieces because ``ZstdDecompressor().decompress(max_output_size=cap)`` ignores
    the cap when the frame header declares a size; pieces are joined once at the end, since
    growing one buffer holds the GIL through every reallocation (229 ms event-loop gaps)."""
    import zstandard

    if zstandard.frame_content_size(data) > cap:  # -1 when the header does not say
        return None
    pieces, total = [], 0
    with zstandard.ZstdDecompressor().stream_reader(data) as reader:
        while piece := reader.read(_PIECE):
            pieces.append(piece)
            total += len(piece)
            if total > cap:
                return None
    return b"".join(pieces)


class Bodies:
    """The body pool and the in-flight byte budget of one server (shared by the guard, which
    reads and decompresses bodies, and the runtime, which parses them)."""

    def __init__(self, max_inflight_bytes: int) -> None:
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight_bytes = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def of(cls, config: Any) -> Bodies:
        return cls(config.max_inflight_body_bytes or 4 * config.max_body_bytes)

    # ---- the budget (event loop only) ---------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Count ``n`` more bytes in flight, unless that passes the budget (a body bigger than
        the whole budget still passes when nothing else is in flight)."""
        if self.inflight_bytes and self.inflight_bytes + n > self.max_inflight_bytes:
            return False
        self.inflight_bytes += n
        return True

    def release(self, n: int) -> None:
        self.inflight_bytes -= n

    # ---- off the loop ---------------------------------------------------------------------------
    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: at once for a body of at most :data:`SMALL_BODY` bytes, else on the pool."""
        if size <= SMALL_BODY:
            return fn(*args)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="skyrl-body")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, raw: bytes, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` for the body ``raw`` (see :meth:`run`)."""
        return await self.run(len(raw), fn, *args)

    async def unzstd(self, data: bytes, cap: int) -> bytes | None:
        """:func:`unzstd_capped` (a zstd frame is small however much it inflates: always on the pool)."""
        return await self.run(SMALL_BODY + 1, unzstd_capped, data, cap)
