"""A Tinker-compatible HTTP server (``skyrl-sdk serve``): the official ``tinker`` client and
tinker-cookbook recipes train against skyrl-sdk Backends unchanged.

Modules, one job each: ``config`` (settings), ``guard`` (what is decided at the headers: head
size, /healthz, API key -> owner, query integers; then body limits, zstd), ``origins`` (the
Host / Origin / Content-Type checks of a server without keys), ``bodies`` (decompression and
parsing off the event loop, the in-flight budget), ``edge`` (uvicorn with a header timeout, a
connection cap that drops stalled bodies, a short linger, shutdown order), ``statedir`` (one
server per state dir, a start on a writable one), ``reconcile`` (unrecorded checkpoint
directories at start-up), ``caps`` (metadata sizes, open sessions), ``visibility`` (what
``/loaded`` shows whom),
``executor`` (the compute thread, fair turns), ``futures`` (jobs, seq_id ordering, long-poll
results), ``store`` (SQLite records and checkpoint paths), ``wire`` (JSON requests and
answers), ``proto`` (protobuf messages), ``served`` (served models and their limits),
``memory`` (the memory budget), ``sessions`` (client sessions and their expiry),
``sampling`` (sampling sessions, sampler cache), ``snapshots`` (pinned weights), ``history``
(metrics per step, for the console), ``runtime`` (models, request ordering; the one entry for
routes), ``routes`` (HTTP endpoints), ``console`` (the browser console: its page and JSON),
``app`` (``create_app``). See docs/server.md.
"""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
