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
        from skyrl_sdk.server import ServerConfig, create_app
        from skyrl_sdk.server.http import edge

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

    def rest_client(self, api_key: str = API_KEY):
        import tinker

        return tinker.RestClient(base_url=self.url, api_key=api_key)


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


class ServeProcess:
    """``skyrl-sdk serve`` as users run it: a process of its own (real uvicorn, real sockets), its
    stderr kept in ``log``. ``with ServeProcess(state_dir, "--api-key", KEY) as srv: srv.url``;
    ``wait=False`` does not wait for it to answer (a start that is meant to fail)."""

    def __init__(self, state_dir: Path | str, *args: str, port: int | None = None, wait: bool = True,
                 env: dict | None = None, preexec_fn: Any = None) -> None:
        import subprocess
        import sys
        import tempfile

        self.port = port or free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="skyrl-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skyrl_sdk.cli", "serve", "--lazy", "--port", str(self.port), "--state-dir",
             str(state_dir), *args], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, preexec_fn=preexec_fn)
        if wait:
            self.wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + HANG_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"skyrl-sdk serve exited ({self.proc.returncode}): {self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("skyrl-sdk serve did not start")
            time.sleep(0.1)

    def wait_exit(self) -> int:
        return self.proc.wait(HANG_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(HANG_S)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
