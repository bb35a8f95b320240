"""Ray placement shared by skyrl-sdk's plugins (docs/distributed.md).

- :mod:`.cluster`: join the cluster named by ``RAY_ADDRESS`` or a config's ``ray_address``, else
  start a local one owned by this process; a cluster on the loopback address is joined there.
- :mod:`.placement`: a placement group of bundles and the options that put an actor on one.
- :mod:`.calls`: wait for actor calls, and name the actor when one died.
- :mod:`.loopback`: ``python -m skyrl_sdk_ray.loopback start ...``: ``ray start`` that keeps a
  ``127.0.0.1`` node address (tests, single-machine CI).
- :mod:`.local_cluster`: :class:`~.local_cluster.LoopbackCluster`, nodes started with it and
  stopped by the pids of their own processes (never ``ray stop``).

Importing this package imports nothing of Ray; its functions do.
"""

from __future__ import annotations

__version__ = "0.1.0"
