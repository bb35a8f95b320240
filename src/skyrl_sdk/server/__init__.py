"""A Tinker-compatible HTTP server (``skyrl-sdk serve``): the official ``tinker`` client and
tinker-cookbook recipes train against skyrl-sdk Backends unchanged.

Modules, one job each: ``config`` (settings), ``guard`` (what is decided at the headers: head
size, /healthz, API key -> owner, query integers; then body limits, zstd), ``origins`` (the
Host / Origin / Content-Type checks of a server without keys), ``bodies`` (decompression and
parsing off the event loop, the in-flight budget), ``edge`` (uvicorn with a header timeout, a
connection cap that drops stalled bodies, a short linger, shutdown order), ``statedir`` (one
server per state dir, a start on a writable one), ``reconcile`` (unrecorded checkpoint
directories at start-up), ``caps`` (metadata sizes, open sessions), ``visibility`` (what
``/loaded`` shows whom), ``executor`` (the compute thread, fair turns in
``engines.turns.RoundRobin`` order), ``futures`` (jobs, seq_id ordering, long-poll results),
``store`` (SQLite records and checkpoint directories), ``tinker_paths``
(``tinker://`` paths, ids and names, checked), ``wire`` (JSON requests and answers),
``proto`` (protobuf answers), ``served`` (served models and their limits), ``memory`` (the
memory budget), ``sessions`` (client sessions and their expiry), ``sampling`` (sampling
sessions, sampler cache), ``snapshots`` (pinned weights), ``history`` (metrics per step, for
the console), ``catalog`` (an owner's runs, checkpoints and curves, publishing, time to live
and session search: for the catalog routes, the RestClient's routes and the console),
``weights`` (the requests that save weights, the expiry sweep), ``exports`` (external weights
and their signed download links), ``runtime`` (models, request ordering; the one entry for
routes, holding the sessions and the catalog), ``routes`` (HTTP endpoints), ``rest`` (the
RestClient's routes beyond listing, and the declined ones' 404), ``compat`` (the
compatibility matrix, from the client's routes), ``console`` (the browser console: its page
and JSON), ``app`` (``create_app``). Request values are read by :mod:`skyrl_sdk.inputs` (the
protobuf request by ``inputs.tinker_proto``). See docs/server.md.
"""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
