"""Run a real ``skyrl-sdk serve`` app (uvicorn, loopback, free port) in a background thread
for tests that drive the unmodified ``tinker`` client against it."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from _limits import HANG_S

os.environ.setdefault("TINKER_TELEMETRY", "0")

API_KEY = "tml-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """``with ServerThread(state_dir, **config) as srv: srv.url``"""

    def __init__(self, state_dir: Path | str, **config: Any) -> None:
        from skyrl_sdk.server import ServerConfig, create_app, edge

        self.port = free_port()
        config.setdefault("api_key", API_KEY)
        self.config = ServerConfig(state_dir=state_dir, port=self.port, **config)
        self.app = create_app(self.config)
        # the edge `skyrl-sdk serve` runs (h11 with the header timeout and connection cap)
        self.server = edge.Server(edge.server_config(self.app, self.config, host="127.0.0.1"))
        self.thread = threading.Thread(target=self.server.run, name="skyrl-test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def runtime(self):
        return self.app.fastapi.state.runtime

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + HANG_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_S)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def service_client(self, api_key: str = API_KEY):
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=api_key)


def raw_client(server: ServerThread, api_key: str | None = API_KEY):
    """A plain httpx client for raw requests (no key header when ``api_key`` is None)."""
    import httpx

    headers = {"X-API-Key": api_key} if api_key is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=HANG_S)


def wait_result(http, request_id: str):
    """Long-poll ``retrieve_future`` until the answer is not ``try_again``."""
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r


def next_token_datum(n: int):
    """A tinker ``Datum`` of ``n`` tokens 1..n, each predicting the next."""
    from tinker import types as tt

    ids = np.arange(1, n + 2)
    return tt.Datum(model_input=tt.ModelInput.from_ints(ids[:-1].tolist()),
                    loss_fn_inputs={"target_tokens": tt.TensorData.from_numpy(ids[1:])})
