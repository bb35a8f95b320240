"""A Tinker-compatible HTTP server (``skyrl-sdk serve``): the official ``tinker`` client and
tinker-cookbook recipes train against skyrl-sdk Backends unchanged.

Modules, one job each: ``config`` (settings), ``guard`` (API key -> owner, body limit,
zstd), ``futures`` (workers, seq_id ordering, long-poll results), ``store`` (SQLite records
and checkpoint paths), ``wire`` (JSON requests and answers), ``proto`` (protobuf messages),
``served`` (served models and their limits), ``sessions`` (client sessions and their
expiry), ``catalog`` (an owner's training runs and checkpoints), ``sampling`` (sampling
sessions, sampler cache, snapshots), ``runtime`` (models, request ordering; the one entry
for routes), ``routes_*`` (HTTP endpoints), ``app`` (``create_app`` and ``serve``). See docs/server.md.
"""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
