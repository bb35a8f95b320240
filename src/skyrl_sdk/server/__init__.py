"""A Tinker-compatible HTTP server (``skyrl-sdk serve``): the official ``tinker`` client and
tinker-cookbook recipes train against skyrl-sdk Backends unchanged.

Modules, one job each: ``config`` (settings), ``guard`` (API key, body limit, zstd),
``futures`` (workers, seq_id ordering, long-poll results), ``store`` (SQLite records and
checkpoint paths), ``wire`` (Tinker protobuf/JSON <-> skyrl-sdk types), ``runtime``
(models, samplers and the jobs that run requests), ``routes_*`` (HTTP endpoints), ``app``
(``create_app`` and ``serve``). See docs/server.md.
"""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
