"""docs/server.md's compatibility matrix is generated from the installed tinker client's
routes, and every row agrees with what the server answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from _server_harness import ServerThread, raw_client
from skyrl_sdk.server.wire import compat

DOCS = Path(__file__).resolve().parent.parent / "docs" / "server.md"


def test_every_client_route_has_a_row_and_every_row_a_client_route():
    routes = compat.client_routes()
    assert len(routes) > 40  # the extraction found the client's calls (tinker 0.38: 47)
    assert sorted(set(routes) - set(compat.ROWS)) == []  # a new client route needs a row
    assert sorted(set(compat.ROWS) - set(routes)) == []  # a row whose route the client dropped


def test_the_docs_carry_the_generated_matrix():
    text = DOCS.read_text()
    block = text.split(compat.MARK_START)[1].split(compat.MARK_END)[0].strip()
    assert block == compat.render_matrix(), "regenerate it: python -m skyrl_sdk.server.wire.compat"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tmp_path_factory.mktemp("state")) as srv:
        yield srv


@pytest.mark.parametrize("route", sorted(compat.ROWS, key=lambda r: (r[1], r[0])), ids=lambda r: f"{r[0]} {r[1]}")
def test_each_row_agrees_with_the_servers_answer(server, route):
    """A served route is routed (whatever its answer to dummy ids and an empty body, never the
    router's 404 or 405); a declined one answers the one documented 404."""
    method, template = route
    path = re.sub(r"{checkpoint_id}", "weights/nothing", template)
    path = re.sub(r"{[^}]+}", "nothing", path)
    with raw_client(server) as http:
        answer = http.request(method, path, content=b"{}" if method in ("POST", "PUT") else None,
                              headers={"Content-Type": "application/json"})
    detail = answer.json().get("detail") if answer.headers.get("content-type", "").startswith("application/json") \
        else None
    served, _, _ = compat.ROWS[route]
    if served:
        assert answer.status_code != 405, f"{method} {path}: the row says served, the server has no such method"
        assert not (answer.status_code == 404 and detail in ("Not Found", None)), f"{method} {path}: not routed"
        assert not str(detail or "").startswith(compat.NOT_SERVED_PREFIX)
    else:
        assert answer.status_code == 404 and detail == compat.not_served_detail(method, template)
