"""A Tinker-compatible HTTP server (``skyrl-sdk serve``): the official ``tinker`` client and
tinker-cookbook recipes train against skyrl-sdk Backends unchanged.

Its folders are its layers, bottom to top; a module imports from its own layer and those below:

- ``settings`` and ``config`` at the root: every setting declared once (name, type, default,
  help, ``serve`` flag), and ``ServerConfig``, the settings of one server, which every layer reads;
- ``wire/``: what crosses the wire, as values: request bodies (``bodies``), Tinker's JSON
  envelopes and answers (``envelopes``), the session search request (``session_query``),
  protobuf answers (``proto``), ``tinker://`` paths (``tinker_paths``), metadata caps
  (``caps``), the client's routes (``compat``);
- ``state/``: what survives a restart, in the state dir: the lock (``statedir``), SQLite records
  and checkpoint directories (``store``, ``reconcile``), metrics per step (``history``, what a
  step's calls tell: ``step_stats``), session search (``session_search``);
- ``compute/``: the models and the work on them: ``runtime`` (the one entry for routes), the
  compute thread (``executor``), jobs and their order (``futures``), served models and the memory
  budget (``served``, ``memory``), client and sampling sessions (``sessions``, ``sampling``,
  ``snapshots``), sequences recorded for ``stable_reinforce`` (``recorded``), saves and exports
  (``weights``, ``exports``), the catalog (``catalog``, ``visibility``);
- ``http/``: the HTTP edge: uvicorn with its connection accounting (``edge``), what is decided at
  the headers (``guard``, ``origins``), the routes (``routes``, ``rest``), the console (``console``
  + ``static/``), ``create_app`` (``app``).

Request values are read by :mod:`skyrl_sdk.inputs` (the protobuf request by ``inputs.tinker_proto``).
See docs/server.md and docs/architecture.md.
"""

from typing import Any

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .http import app

        return getattr(app, name)
    raise AttributeError(name)
