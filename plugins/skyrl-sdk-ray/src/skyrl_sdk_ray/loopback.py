"""``python -m skyrl_sdk_ray.loopback start --head --node-ip-address 127.0.0.1 ...``: Ray's own
``ray`` command, except that a loopback address stays one.

``ray start --node-ip-address 127.0.0.1`` registers the node under the machine's interface
address instead (:mod:`.cluster` says why); with this entry point the node, its GCS and its
workers listen on ``127.0.0.1`` only, and :func:`~skyrl_sdk_ray.cluster.connect` joins them there.
For tests and single-machine runs that must not listen on another address.
"""

from __future__ import annotations

import sys


def main() -> None:
    from ray._private import services  # see skyrl_sdk_ray.cluster.keep_loopback
    from ray.scripts.scripts import main as ray_main

    services.resolve_ip_for_localhost = lambda host: host
    sys.argv[0] = "ray"
    ray_main()


if __name__ == "__main__":
    main()
