"""No route waits for the disk on the event loop: every state-dir and database call of the server
runs on a thread (issue 40), checked across every route of the app at once.

Every method of the state layer (``Store``, ``History``) and the file checks the routes reach
(a sampler checkpoint's safetensors headers, an export's file listing, a download's file) are
wrapped: called on the event loop's thread, the call is recorded with the request it served;
called on any other thread, it waits until the event loop answers (so a route that blocked the
loop on it would never finish). Then every route of the app is exercised, through the unmodified
tinker client where it has one, and the test fails on any recorded call, and on any route it did
not exercise: a new route fails here until it is exercised, and then only if it reads the state
on the loop. The reaper and the expiry sweep (timers on the loop) are run too.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import re
import threading
import time
import traceback
import urllib.request

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
from tinker import types as tt

from _limits import HANG_S
from _server_harness import ServerThread, next_token_datum, raw_client
from skyrl_sdk.server.compute import exports, sampling
from skyrl_sdk.server.state.history import History
from skyrl_sdk.server.state.store import Store
from skyrl_sdk.server.wire.compat import ROWS

pytestmark = [pytest.mark.filterwarnings("ignore::tinker.ExperimentalWarning"),
              pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")]

#: methods of the state layer that read nothing from disk, and why (the loop may call them)
IN_MEMORY = {
    (Store, "redact"): "run directories are named from an in-memory map (every error the loop answers is redacted)",
    (Store, "run_id_of_dirname"): "the in-memory map of run directories",
    (Store, "run_dirname"): "a hash of the run id",
    (History, "_computed"): "a done-callback filling the in-memory curves cache",
}
#: routes the guard answers before routing, and why (they never reach the app)
ANSWERED_BY_THE_GUARD = {("GET", "/api/v1/healthz"): "touching nothing, so a health check works under any load"}
#: file work outside the state layer that routes reach: (module or class, attribute)
FILE_CALLS = ((sampling, "weights_problem"), (exports, "public_files"), (exports.DownloadLinks, "file"))

_request: contextvars.ContextVar[str | None] = contextvars.ContextVar("request", default=None)


class Guard:
    """Records state calls made on the loop's thread; off it, waits for the loop to answer."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None
        self.on_loop: list[str] = []
        self.off_loop: set[str] = set()

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            if self.loop_thread is not None and threading.current_thread() is self.loop_thread:
                where = "".join(traceback.format_stack(limit=6)[:-1])
                self.on_loop.append(f"{name} on the event loop (request: {_request.get()}):\n{where}")
            elif self.loop is not None:
                self.off_loop.add(name)
                self._wait_for_the_loop()
            return fn(*args, **kwargs)

        return guarded

    def _wait_for_the_loop(self) -> None:
        answered = threading.Event()
        try:
            self.loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # the loop is closed (shutdown)
            return
        deadline = time.monotonic() + HANG_S
        while not answered.wait(0.05):
            if not self.loop.is_running():  # stopped meanwhile (shutdown)
                return
            assert time.monotonic() < deadline, "the event loop did not answer while a state call ran"


def _install(monkeypatch, guard: Guard) -> None:
    for cls in (Store, History):
        for name, raw in list(vars(cls).items()):
            if (cls, name) in IN_MEMORY or name.startswith("__"):
                continue
            if isinstance(raw, staticmethod):
                monkeypatch.setattr(cls, name, staticmethod(guard.wrap(raw.__func__, f"{cls.__name__}.{name}")))
            elif inspect.isfunction(raw) and not inspect.iscoroutinefunction(raw):
                monkeypatch.setattr(cls, name, guard.wrap(raw, f"{cls.__name__}.{name}"))
    for owner, name in FILE_CALLS:
        monkeypatch.setattr(owner, name, guard.wrap(getattr(owner, name), name))


class RouteRecorder:
    """ASGI middleware: which route served each request (``scope["route"]`` once routed), and the
    request in a context variable (what a call on the loop is reported with)."""

    def __init__(self, app, seen: set) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = _request.set(f"{scope['method']} {scope['path']}")
        try:
            await self.app(scope, receive, send)
        finally:
            _request.reset(token)
            if (route := scope.get("route")) is not None:
                self.seen.add((scope["method"], route.path))


def app_routes(routes) -> set[tuple[str, str]]:
    """(method, path) of every route, routers included as FastAPI nests them."""
    found = set()
    for route in routes:
        if hasattr(route, "original_router"):
            found |= app_routes(route.original_router.routes)
        elif hasattr(route, "routes") and not hasattr(route, "methods"):
            found |= app_routes(route.routes)
        else:
            found |= {(m, route.path) for m in route.methods if m != "HEAD"}
    return found


def test_no_route_reads_the_state_on_the_event_loop(tmp_path, monkeypatch):
    guard, seen = Guard(), set()
    srv = ServerThread(tmp_path / "state")
    srv.app.fastapi.add_middleware(RouteRecorder, seen=seen)
    with srv, raw_client(srv) as http:
        rt = srv.runtime
        guard.loop, guard.loop_thread = rt.loop, srv.thread
        _install(monkeypatch, guard)
        # ---- the service routes
        assert http.get("/api/v1/healthz").status_code == 200
        for route in ("client/config", "client/dynamic_config", "telemetry", "cancel_future"):
            assert http.post(f"/api/v1/{route}", json={}).status_code == 200, route
        assert http.get("/api/v1/get_server_capabilities").status_code == 200
        # ---- training, sampling and saves through the tinker client
        sc = srv.service_client()
        tc = sc.create_lora_training_client(base_model="tiny", rank=4).result(timeout=HANG_S)
        tc.get_info()
        tc.forward_backward([next_token_datum(8)], "cross_entropy").result(timeout=HANG_S)
        tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=HANG_S)
        state = tc.save_state("state-1").result(timeout=HANG_S).path
        tc.load_state(state).result(timeout=HANG_S)
        sc.create_training_client_from_state(state).result(timeout=HANG_S)
        sampler_path = tc.save_weights_for_sampler("sampler-1").result(timeout=HANG_S).path
        prompt, params = tt.ModelInput.from_ints([1, 2, 3]), tt.SamplingParams(max_tokens=2)
        for client in (tc.save_weights_and_get_sampling_client(), sc.create_sampling_client(model_path=sampler_path),
                       sc.create_sampling_client(base_model="tiny")):
            client = client.result(timeout=HANG_S)
            assert len(client.sample(prompt, 1, params).result(timeout=HANG_S).sequences) == 1
        export = tc.save_weights_external("export-1").result(timeout=HANG_S).path
        # ---- the catalog and the RestClient's routes
        rest = srv.rest_client()
        urls = rest.get_external_weights_urls(export).result(timeout=HANG_S).urls
        assert urllib.request.urlopen(urls["config.json"], timeout=HANG_S).status == 200
        assert rest.list_training_runs().result(timeout=HANG_S).training_runs
        rest.get_training_run(tc.model_id).result(timeout=HANG_S)
        rest.list_checkpoints(tc.model_id).result(timeout=HANG_S)
        rest.list_user_checkpoints().result(timeout=HANG_S)
        rest.get_weights_info_by_tinker_path(sampler_path).result(timeout=HANG_S)
        rest.publish_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
        rest.unpublish_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
        rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result(timeout=HANG_S)
        rest.delete_checkpoint_from_tinker_path(sampler_path).result(timeout=HANG_S)
        session_id = sc.holder.get_session_id()
        assert session_id in rest.list_sessions().result(timeout=HANG_S).sessions
        rest.get_session(session_id).result(timeout=HANG_S)
        rest.search_sessions(tt.SessionSearchRequest()).result(timeout=HANG_S)
        sampler_id = next(s for s in rt.sampling.sessions if s.startswith(session_id))
        assert http.get(f"/api/v1/samplers/{sampler_id}").status_code == 200
        assert http.get("/api/v1/loaded").status_code == 200
        # ---- the console
        for path in ("/", "/console/console.css", "/console/console.js", "/console/charts.js", "/console/api/me",
                     "/console/api/runs", f"/console/api/runs/{tc.model_id}", f"/console/api/runs/{tc.model_id}/curves",
                     "/console/api/server"):
            assert http.get(path).status_code == 200, path
        # ---- the routes this server declines (a clean 404 each)
        for (method, path), (served, _, _) in ROWS.items():
            if not served:
                assert http.request(method, re.sub(r"\{[^}]+\}", "x", path)).status_code == 404, path
        # ---- heartbeats, a session the reaper expires, the expiry sweep, a finished session
        assert http.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 200
        silent = http.post("/api/v1/create_session", json={}).json()["session_id"]

        def forget():  # on the loop: the silent session was last seen long ago; the reaper's next round
            rt.sessions.seen(silent, at=time.monotonic() - 10 * rt.config.session_timeout_s)
            rt.sessions.reap()
            rt.weights.sweep_expired()

        rt.loop.call_soon_threadsafe(forget)
        deadline = time.monotonic() + HANG_S
        while http.post("/api/v1/session_heartbeat", json={"session_id": silent}).status_code != 410:
            assert time.monotonic() < deadline, "the reaper did not expire the silent session"
            time.sleep(0.05)
        sc.close("success").result(timeout=HANG_S)
        routes = app_routes(srv.app.fastapi.routes)
    assert not guard.on_loop, "state calls on the event loop:\n\n" + "\n\n".join(guard.on_loop)
    assert routes - seen - set(ANSWERED_BY_THE_GUARD) == set(), "routes this test does not exercise (add them above)"
    # the guards saw the calls the issue names, off the loop
    assert {"Store.add_session", "Store.heartbeat", "Store.finish_session", "Store.add_run", "Store.touch_run",
            "Store.add_sampling_session", "Store.resolve_checkpoint", "weights_problem", "public_files",
            "file"} <= guard.off_loop
