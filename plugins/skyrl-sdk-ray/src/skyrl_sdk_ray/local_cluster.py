"""A Ray cluster of several nodes on 127.0.0.1 (tests, benchmarks, single-machine trials), stopped by
the pids of its own processes.

Every process of the cluster (``ray start``'s daemons, and the workers the raylets start) carries
``SKYRL_RAY_LOCAL_CLUSTER=<id>`` in its environment, inherited from the ``ray start`` that began
it: :meth:`LoopbackCluster.stop` kills exactly those (never ``ray stop``, which ends every Ray
process of the user, other people's clusters included), also when a test or a benchmark failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MARKER = "SKYRL_RAY_LOCAL_CLUSTER"
#: Ray's ports that default to fixed numbers: every cluster gets free ones (several may run at once)
FIXED_PORT_FLAGS = ("--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port",
                    "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports(head: bool) -> list[str]:
    flags = [f for f in FIXED_PORT_FLAGS if head or f not in ("--ray-client-server-port", "--dashboard-port")]
    return [x for f in flags for x in (f, str(free_port()))]


class LoopbackCluster:
    """``nodes`` Ray nodes on 127.0.0.1 (``cpus_per_node`` CPUs each), started by
    ``python -m skyrl_sdk_ray.loopback start`` (see its docstring)."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 4) -> None:
        self.id = uuid.uuid4().hex[:10]
        # Ray's socket paths must fit 107 bytes: a short temp dir
        self.root = Path(tempfile.mkdtemp(prefix="skr", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, MARKER: self.id}
        try:
            for i in range(nodes):
                head = i == 0
                where = ["--head", "--port", str(self.port), "--include-dashboard", "false"] if head else \
                    ["--address", self.address]
                cmd = [sys.executable, "-m", "skyrl_sdk_ray.loopback", "start", *where, "--node-ip-address",
                       "127.0.0.1", "--num-cpus", str(cpus_per_node), "--num-gpus", "0", "--disable-usage-stats",
                       "--temp-dir", str(self.root / f"n{i}"), *_ports(head)]
                proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"ray start (node {i}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        """This cluster's processes: those whose environment carries its marker."""
        mine = f"{MARKER}={self.id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mine in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.2)

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_marked(cluster_id: str) -> int:
    """Stop this machine's processes of the cluster ``cluster_id`` (those whose environment has
    ``SKYRL_RAY_LOCAL_CLUSTER=<cluster_id>``: start ``ray start`` with it); how many there were."""
    marked = LoopbackCluster.__new__(LoopbackCluster)
    marked.id = cluster_id
    count = len(marked.pids())
    marked.stop()
    return count


def main(argv: list[str] | None = None) -> int:
    """``python -m skyrl_sdk_ray.local_cluster stop ID``: stop the Ray processes this machine runs
    for the cluster started with ``SKYRL_RAY_LOCAL_CLUSTER=ID`` (the GPU scripts' clusters)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "stop":
        print("usage: python -m skyrl_sdk_ray.local_cluster stop CLUSTER_ID", file=sys.stderr)
        return 2
    print(f"stopped {stop_marked(args[1])} processes of Ray cluster {args[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
