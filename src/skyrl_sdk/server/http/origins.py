"""Which browsers' requests a server without API keys answers: DNS rebinding and cross-site
requests.

A keyless server (the default, on loopback) trusts whoever can connect. A web page the user
visits can connect too: it can POST ``text/plain`` to ``http://127.0.0.1:8000`` (a "simple"
request needs no CORS preflight), and with DNS rebinding (its own name resolving to 127.0.0.1)
it can read the answers as same-origin. So, on a keyless server:

- the ``Host`` header must name this server: a loopback name (``localhost``, ``127.0.0.1``,
  ``::1``), the ``--host`` it binds (unless a wildcard), or a name the operator allows with
  ``--allowed-host`` (``*``: any). A rebound name is none of these;
- a state-changing request (``POST``, ``PUT``, ``PATCH``, ``DELETE``) that carries an ``Origin``
  must come from this server's own origin (browsers send ``Origin`` on every cross-site one);
- a ``POST`` must say ``Content-Type: application/json`` (``application/x-protobuf`` on
  ``forward_backward``): a cross-site page cannot send those without a preflight, which this
  server never grants. The tinker client sends them on every request.

A server with keys needs none of this: a page cannot learn a key, and a request without one is
refused at its headers. Refusals are 403 / 415 with a message naming what to change.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

#: the names a keyless server answers unless the operator allows more
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: methods that may change state (the rest are read-only here)
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: ``--allowed-host`` value that allows any Host
ANY_HOST = "*"
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})


def host_name(value: str) -> str:
    """The name of a ``Host`` header or an ``Origin``'s authority, lower-case, without port or
    brackets (``[::1]:8000`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value.rstrip(".")


def allowed_hosts(bind_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """The Host names a keyless server answers (None: any)."""
    extra = [e.strip().lower() for e in extra if e.strip()]
    if ANY_HOST in extra:
        return None
    names = set(LOOPBACK_NAMES) | {host_name(e) for e in extra}
    if bind_host not in _WILDCARD_BINDS:
        names.add(host_name(bind_host))
    return frozenset(names)


def refusal(method: str, path: str, headers: dict[str, bytes], allowed: frozenset[str] | None,
            protobuf_paths: frozenset[str]) -> tuple[int, str] | None:
    """(status, detail) when a keyless server must refuse this request, else None."""
    if allowed is not None:
        host = headers.get("host", b"").decode("latin-1")
        if host_name(host) not in allowed:
            return 403, (f"Host {host[:100]!r} is not a name this server answers: without API keys it answers "
                         f"{', '.join(sorted(allowed))} (start it with --allowed-host NAME to allow another, or give "
                         f"it --api-key)")
    if method in STATE_CHANGING and (origin := headers.get("origin")) is not None:
        text = origin.decode("latin-1")
        authority = urllib.parse.urlsplit(text).netloc.lower() if "://" in text else None
        if authority != headers.get("host", b"").decode("latin-1").strip().lower():
            return 403, (f"Origin {text[:100]!r}: a server without API keys takes state-changing requests only from "
                         f"its own pages (same origin) and from clients that are not browsers")
    if method == "POST":
        wanted = "application/x-protobuf" if path in protobuf_paths else "application/json"
        given = headers.get("content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
        if given != wanted:
            return 415, (f"Content-Type {given[:100] or '(none)'!r}: this route takes {wanted} (a server without API "
                         f"keys refuses other types, which a web page could send across sites)")
    return None
