"""The FastAPI application: routes, error answers and the guard around them (``create_app``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ...errors import InputError, NotFoundError, clipped, quoted
from ...version import __version__
from ..compute.runtime import Runtime
from ..config import ServerConfig
from ..state.statedir import StateDirLock
from ..wire.bodies import Bodies
from . import console, origins, rest, routes
from .guard import Guard

logger = logging.getLogger(__name__)


def create_app(config: ServerConfig | None = None, state_lock: StateDirLock | None = None) -> Any:
    """A Tinker-compatible ASGI app serving ``config.models``.

    The returned object is the FastAPI app wrapped in the auth / body-limit middleware;
    the FastAPI app itself is its ``.fastapi`` attribute (its ``state.runtime`` holds the
    live :class:`~.runtime.Runtime` while the app runs), ``.begin_shutdown()`` fails the
    work that has not run and answers its long-polls, and ``await .settle()`` waits for the
    running job (the server calls both at the first signal, before it drains connections).
    ``state_lock``: the state dir's lock, taken by ``skyrl-sdk serve`` before its checks (else
    the runtime takes it at start-up)."""
    config = config or ServerConfig()
    bodies = Bodies.of(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.runtime = Runtime(config, asyncio.get_running_loop(), bodies, state_lock)
        logger.info("skyrl-sdk serve: models %s, state dir %s", list(config.models), config.state_dir)
        try:
            yield
        finally:
            app.state.runtime.begin_shutdown()
            app.state.runtime.sessions.stop()
            await asyncio.get_running_loop().run_in_executor(None, app.state.runtime.close)

    app = FastAPI(title="skyrl-sdk Tinker-compatible server", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    def detail(request: Request, message: str) -> dict:
        return {"detail": clipped(request.app.state.runtime.redact(message))}

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes each bad value in full; name the parameter, quote a little
        problems = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}, got {quoted(e.get('input'))}"
                    for e in exc.errors()[:5]]
        return JSONResponse(detail(request, "; ".join(problems)), status_code=400)

    @app.exception_handler(NotFoundError)
    async def _unknown(request: Request, exc: NotFoundError) -> JSONResponse:
        return JSONResponse(detail(request, str(exc)), status_code=404)

    @app.exception_handler(InputError)
    async def _bad_input(request: Request, exc: InputError) -> JSONResponse:
        return JSONResponse(detail(request, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _ours(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(detail(request, f"internal server error: {type(exc).__name__}: {exc}"), status_code=500)

    app.include_router(rest.router)  # before routes: see rest's docstring
    app.include_router(routes.router)
    app.include_router(console.router)
    guarded = Guard(app, config.owners(), config.max_body_bytes, bodies, max_json_body_bytes=config.max_json_body_bytes,
                    body_timeout_s=config.body_timeout_s, body_idle_timeout_s=config.body_idle_timeout_s,
                    zstd=bool(config.client_config.get("proto_compress_fwdbwd")),
                    allowed_hosts=origins.allowed_hosts(config.host, config.allowed_hosts))
    guarded.fastapi = app  # type: ignore[attr-defined]

    def begin_shutdown() -> None:
        runtime = getattr(app.state, "runtime", None)
        if runtime is not None:
            runtime.begin_shutdown()

    async def settle(give_up: Any = lambda: False) -> None:
        runtime = getattr(app.state, "runtime", None)
        if runtime is not None:
            await runtime.settle(give_up)

    guarded.begin_shutdown = begin_shutdown  # type: ignore[attr-defined]
    guarded.settle = settle  # type: ignore[attr-defined]
    return guarded
