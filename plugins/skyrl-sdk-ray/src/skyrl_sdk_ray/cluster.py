"""Joining a Ray cluster, or starting one.

Which cluster: the ``address`` a config names (``engine_config["ray_address"]``,
``sampler_config["ray_address"]``), else ``RAY_ADDRESS``, else a local cluster that this process
starts and that ends with it. A process that is already connected stays on its cluster (one
cluster per process is Ray's rule); asking for another one then is an error naming both.

**Loopback.** Ray turns ``127.0.0.1`` into the machine's interface address, both in ``ray start``
and in ``ray.init`` (ray-project/ray#59110, by design since 2018), so a cluster cannot be kept on
the loopback address with Ray's own commands. :mod:`.loopback` starts nodes that keep it, and
:func:`connect` joins such a cluster (its GCS answers on ``127.0.0.1``) without the rewrite.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

from skyrl_sdk.errors import InputError

logger = logging.getLogger(__name__)

#: environment variables every actor gets from the process that places it (threads, offline hubs,
#: vLLM's and skyrl-sdk's own settings); the rest of the environment stays the node's
FORWARDED_ENV_PREFIXES = ("SKYRL_", "VLLM_", "HF_", "TRANSFORMERS_", "TINKER_", "OMP_NUM_THREADS",
                          "TOKENIZERS_PARALLELISM", "MALLOC_ARENA_MAX", "GLOO_SOCKET_IFNAME", "NCCL_")

_joined: str | None = None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def keep_loopback(address: str | None) -> Iterator[None]:
    """While joining ``address``: when its GCS answers on a loopback host, keep that host (Ray
    would rewrite it to the interface address, where such a cluster does not listen)."""
    host, _, port = (address or "").rpartition(":")
    if not (host and port.isdigit() and is_loopback(host) and _answers(host, int(port))):
        yield
        return
    from ray._private import services  # the one place Ray rewrites loopback addresses (no public switch)

    rewrite = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda h: h
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = rewrite


def connect(address: str | None = None) -> str:
    """Join the cluster at ``address`` (else ``RAY_ADDRESS``), or start a local one; return a
    line saying which (see the module docstring)."""
    global _joined
    import ray

    wanted = address or os.environ.get("RAY_ADDRESS") or None
    if ray.is_initialized():
        if wanted is not None and _joined is not None and wanted != _joined:
            raise InputError(f"ray_address {wanted!r}: this process is already connected to the Ray cluster at "
                             f"{_joined!r} (one cluster per process)")
        return f"Ray cluster at {_joined or 'this process'} (connected already)"
    kwargs: dict[str, Any] = dict(ignore_reinit_error=True, logging_level=logging.WARNING,
                                  namespace="skyrl-sdk")
    if wanted is None:
        ray.init(include_dashboard=False, **kwargs)
        _joined = "local"
        return "a local Ray cluster started by this process"
    host = wanted.rpartition(":")[0]
    with keep_loopback(wanted):
        ray.init(address=wanted, _node_ip_address=host if is_loopback(host) else None, **kwargs)
    _joined = wanted
    return f"the Ray cluster at {wanted}"


def node_ip() -> str:
    """The address of this process's node as the cluster knows it (other nodes reach it there)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    return ray.util.get_node_ip_address()


def actor_env() -> dict[str, str]:
    """The environment variables forwarded to actors (``FORWARDED_ENV_PREFIXES``)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def cluster_resources() -> dict[str, float]:
    import ray

    return dict(ray.cluster_resources())
