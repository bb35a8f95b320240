"""Reaching a :class:`~.replica.Replica` wherever it runs: ``handle.call(method, *args)`` returns a
pending call whose ``result()`` is the method's value, or :class:`EngineGone` naming the engine
when its process died.

- :class:`InProcess`: the replica in this process (calls run on a thread, so a push can be
  received while this thread sends it).
- :class:`ChildProcess`: the replica in a child process of this one, over a socket pair (pickled
  calls between two processes of ours). Used for ``placement="local"`` when this process is
  already part of a ``torch.distributed`` job (torchrun): an in-process vLLM would take that
  job's process group for its own and call ``new_group`` on every rank (the hang of issue 38).
- :class:`RayActor`: the replica as a Ray actor (``placement="ray"``).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

#: environment variables of a torchrun job that a child engine must not see (it is no rank)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING")


class EngineGone(Exception):
    """The engine's process died (or was lost with its node)."""

    def __init__(self, name: str, cause: str) -> None:
        super().__init__(f"{name} died ({cause})")
        self.name, self.cause = name, cause


class _Future:
    """A pending call run on a thread of this process."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


class InProcess:
    """A replica in this process."""

    def __init__(self, index: int, facts: Mapping[str, Any], config: Mapping[str, Any], backend: str) -> None:
        from .replica import Replica

        self.name = f"vllm engine {index} (in this process)"
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"skyrl-vllm{index}")
        self.replica: Replica | None = Replica(facts, config, backend)  # None once killed

    def call(self, method: str, *args: Any) -> _Future:
        return _Future(self.pool.submit(getattr(self.replica, method), *args))

    def kill(self) -> None:
        replica, self.replica = getattr(self, "replica", None), None
        if replica is not None:
            replica.close()
        self.pool.shutdown(wait=False)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    return env


class ChildProcess:
    """A replica in a child process (see the module docstring); it exits when this process does."""

    def __init__(self, index: int, facts: Mapping[str, Any], config: Mapping[str, Any], backend: str) -> None:
        mine, theirs = socket.socketpair()
        env = {**_child_env(), "SKYRL_VLLM_PARENT_PID": str(os.getpid()), "SKYRL_VLLM_FD": str(theirs.fileno())}
        code = "from skyrl_sdk_vllm.handles import child_main; child_main()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.conn = Connection(mine.detach())
        self.name = f"vllm engine {index} (child process {self.proc.pid})"
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"skyrl-vllm{index}")
        self.call("__init__", facts, config, backend).result()

    def _exchange(self, method: str, args: tuple) -> Any:
        with self.lock:
            try:
                self.conn.send((method, args))
                while not self.conn.poll(0.2):
                    if self.proc.poll() is not None:
                        raise EngineGone(self.name, f"exit code {self.proc.returncode}")
                status, value = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise EngineGone(self.name, f"{type(exc).__name__}, exit code {self.proc.poll()}") from None
        if status == "error":
            raise value
        return value

    def call(self, method: str, *args: Any) -> _Future:
        return _Future(self.pool.submit(self._exchange, method, args))

    def kill(self) -> None:
        try:
            self.conn.send(("close", ()))
            self.proc.wait(timeout=30)
        except (OSError, EOFError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.pool.shutdown(wait=False)


def child_main() -> None:
    """The child process's loop: build the replica, then serve calls until told to close."""
    from .replica import Replica

    parent = int(os.environ["SKYRL_VLLM_PARENT_PID"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(17)

    threading.Thread(target=watch, daemon=True).start()
    conn = Connection(int(os.environ["SKYRL_VLLM_FD"]))
    replica = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if method == "__init__":
                replica = Replica(*args)
                value = None
            else:
                value = getattr(replica, method)(*args)
            conn.send(("ok", value))
        except Exception as exc:  # sent to the parent, raised there as itself
            conn.send(("error", exc))
        if method == "close":
            break
    os._exit(0)


class RayActor:
    """A replica as a Ray actor, started with ``options`` (its placement)."""

    def __init__(self, index: int, facts: Mapping[str, Any], config: Mapping[str, Any], backend: str,
                 options: Mapping[str, Any]) -> None:
        import ray

        from .replica import Replica

        self.actor = ray.remote(Replica).options(max_concurrency=1, **options).remote(facts, config, backend)
        self.name = f"vllm engine {index} (Ray actor)"
        where = self.call("where").result()
        self.name = f"vllm engine {index} (Ray actor, pid {where['pid']} on {where['host']})"
        self.pid = where["pid"]

    def call(self, method: str, *args: Any) -> _RayCall:
        return _RayCall(getattr(self.actor, method).remote(*args), self.name)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # gone already
            pass


class _RayCall:
    def __init__(self, ref: Any, name: str) -> None:
        self.ref, self.name = ref, name

    def result(self, timeout: float | None = None) -> Any:
        from skyrl_sdk_ray.calls import ActorGone, gather

        try:
            return gather([self.ref], [self.name], timeout_s=timeout)[0]
        except ActorGone as exc:
            raise EngineGone(self.name, exc.cause) from None

    def done(self) -> bool:
        import ray

        return bool(ray.wait([self.ref], timeout=0)[0])
