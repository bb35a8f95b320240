"""Every HTTP endpoint of the server, as thin handlers over :class:`~.runtime.Runtime`.

Sections: service (health, client config, sessions, telemetry, capabilities), training
(models, forward/backward as protobuf, optimizer, weights, futures), sampling (sessions,
asample) and the catalog (an owner's training runs and checkpoints, which the RestClient and
tinker-cookbook's resume and rolling saves use). Each handler reads the caller's owner (set
by :class:`~.guard.Guard`) and passes it on: another owner's ids read as unknown (404).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...types.numbers import integer_from_text
from ..compute.runtime import Runtime
from ..wire import envelopes
from .edge import WAITING_SCOPE_KEY
from .guard import BODY_SCOPE_KEY, OWNER_SCOPE_KEY

router = APIRouter(prefix="/api/v1")


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def owner(request: Request) -> str:
    """The owner of the request's API key (set by :class:`~.guard.Guard`)."""
    return request.scope[OWNER_SCOPE_KEY]


async def body(request: Request) -> bytes:
    """The request body as the guard read it (no copy), else as starlette reads it."""
    raw = request.scope.get(BODY_SCOPE_KEY)
    return raw if raw is not None else await request.body()


async def json_body(request: Request, route: str) -> dict[str, Any]:
    """The JSON object body of ``route`` (an empty body is ``{}``); InputError when it is not
    one or has a key the route's request does not (:data:`~..wire.envelopes.REQUEST_KEYS`). A large body
    is parsed off the event loop."""
    raw = await body(request)
    return await runtime(request).bodies.parse(raw, envelopes.json_request, raw, route)


async def submit(request: Request, route: str) -> dict[str, Any]:
    """A future route: the runtime accepts the body and answers with a request id."""
    return await runtime(request).submit(owner(request), route, await body(request),
                                         request.headers.get("content-type", ""))


# ---- service -------------------------------------------------------------------------------------
@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(request: Request) -> dict:
    # The client's defaults suit a loopback server; say that plain API keys are used and
    # that none of the optional server features (server-side losses, futures polling) exist.
    # The client cuts forward_backward batches into chunks of at most this many (estimated)
    # bytes; every token costs at least 12 (its id and its int64 target), so chunks stay within
    # --max-tokens-per-request (5 MB, the client's default, is below the default limit). Chunks
    # are sent one after another: then a request proves every earlier seq_id was submitted, and
    # one the client numbered but never sent is skipped at once (futures.Sequencer).
    config = runtime(request).config
    flags = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": False,
             "parallel_fwdbwd_chunks": False,
             "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
             "sample_join_sampling_session": False,
             "fwdbwd_max_chunk_bytes_count": min(5_000_000, 12 * config.max_tokens_per_request)}
    return {**flags, **config.client_config}


@router.post("/client/dynamic_config")
async def client_dynamic_config(request: Request) -> dict:
    return {"sample_cancel_enabled": False}


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict:
    rt = runtime(request)
    return {"supported_models": [
        {"model_name": m, "trainable": True, "sampleable": True} for m in rt.config.models
    ]}


@router.get("/loaded")
async def loaded(request: Request) -> dict:
    """What is loaded: shared bases with their LoRA adapters (bytes, offloaded), own copies, memory."""
    return runtime(request).loaded(owner(request))


@router.post("/create_session")
async def create_session(request: Request) -> dict:
    sid = await runtime(request).sessions.create(owner(request), await json_body(request, "create_session"))
    return {"type": "create_session", "session_id": sid}


@router.post("/session_heartbeat", response_model=None)
async def session_heartbeat(request: Request) -> JSONResponse | dict[str, str]:
    ended = await runtime(request).sessions.heartbeat(owner(request), await json_body(request, "session_heartbeat"))
    if ended is not None:
        return JSONResponse({"detail": ended}, status_code=410)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> dict:
    body = await json_body(request, "finish_session")
    await runtime(request).sessions.finish(owner(request), session_id, body.get("reason"))
    return {}


@router.get("/sessions")
async def list_sessions(request: Request) -> dict:
    return await runtime(request).sessions.list(owner(request), *page(request, 20))


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> dict:
    return await runtime(request).sessions.get(owner(request), session_id)


@router.post("/telemetry")
async def telemetry(request: Request) -> dict:
    await body(request)  # accepted and dropped
    return {"status": "accepted"}


# ---- training ------------------------------------------------------------------------------------
#: Routes answered with a future: the runtime accepts the body (forward_backward's is protobuf)
#: and answers with a request id; the client then long-polls ``/retrieve_future``.
#: the most rows one listing page returns (training runs, checkpoints, sessions)
MAX_PAGE = 1000
FUTURE_ROUTES = ("create_model", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler",
                 "save_weights_external",
                 "load_weights", "asample")


def _future_route(route: str) -> Callable[[Request], Awaitable[dict]]:
    async def handler(request: Request) -> dict:
        return await submit(request, route)

    handler.__name__ = route
    return handler


for _route in FUTURE_ROUTES:
    router.post(f"/{_route}")(_future_route(_route))


@router.post("/get_info")
async def get_info(request: Request) -> dict:
    return await runtime(request).get_info(owner(request), await json_body(request, "get_info"))


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll: the result once ready, else ``try_again`` after ``long_poll_s``. While it
    waits the connection edge may need its connection for a newcomer (its owner holds more
    than its share: :mod:`.edge`): then it answers at once 429 with ``Retry-After`` (the client
    polls again after a pause) and the connection closes."""
    body = await json_body(request, "retrieve_future")
    waiting, ended = request.scope.get(WAITING_SCOPE_KEY), asyncio.Event()
    if waiting is not None:
        waiting.wake, waiting.since = ended.set, asyncio.get_running_loop().time()
    try:
        answer = await runtime(request).retrieve(owner(request), body, ended)
    finally:
        if waiting is not None:
            waiting.wake = None
    if isinstance(answer, dict):
        if ended.is_set() and answer.get("type") == "try_again":
            return JSONResponse({"detail": "this long-poll's connection was needed by another client: your "
                                           "long-polls hold more than your share of this server's connections; "
                                           "poll again shortly"}, status_code=429,
                                headers={"retry-after": "1", "connection": "close"})
        return JSONResponse(answer)
    return Response(content=answer.body, media_type=answer.media_type)


# ---- sampling ------------------------------------------------------------------------------------
@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    sid = await runtime(request).create_sampling_session(owner(request),
                                                         await json_body(request, "create_sampling_session"))
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> dict:
    return await runtime(request).get_sampler(owner(request), sampler_id)


@router.post("/cancel_future")
async def cancel_future(request: Request) -> dict:
    """Accepted and ignored: a sample already queued runs to the end (the client only sends
    this when the server's dynamic config enables it, which this one does not)."""
    await body(request)
    return {}


# ---- catalog: training runs and checkpoints ------------------------------------------------------
def query_integer(request: Request, name: str, default: int, low: int, high: int | None = None) -> int:
    """Query parameter ``name`` as an integer within ``low..high`` (and int64), ``default`` when
    absent; else a 400 naming it: never clamped, never rounded (``20.0``, ``1_000`` and int64's
    overflow are refused: :func:`~skyrl_sdk.types.numbers.integer_from_text`, the one rule)."""
    text = request.query_params.get(name)
    if text is None:
        return default
    return integer_from_text(f"query parameter {name!r}", text, low=low, high=high)


def page(request: Request, limit: int) -> tuple[int, int]:
    """A listing's ``limit`` (0..MAX_PAGE, default ``limit``) and ``offset`` (>= 0, default 0)."""
    return query_integer(request, "limit", limit, 0, MAX_PAGE), query_integer(request, "offset", 0, 0)


@router.get("/training_runs")
async def list_training_runs(request: Request) -> dict:
    return await runtime(request).catalog.training_runs(owner(request), *page(request, 20))


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request) -> dict:
    return await runtime(request).catalog.training_run(owner(request), run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request) -> dict:
    return await runtime(request).catalog.checkpoints(owner(request), run_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict:
    await runtime(request).catalog.delete_checkpoint(owner(request), run_id, checkpoint_id)
    return {}


@router.get("/checkpoints")
async def list_user_checkpoints(request: Request) -> dict:
    return await runtime(request).catalog.checkpoints(owner(request), None, *page(request, 100))


@router.post("/weights_info")
async def weights_info(request: Request) -> dict:
    body = await json_body(request, "weights_info")
    return await runtime(request).catalog.weights_info(owner(request), body.get("tinker_path"))
