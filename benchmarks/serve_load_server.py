"""``skyrl-sdk serve``'s app and edge with a given client config (the load benchmark's probe
server: ``proto_compress_fwdbwd`` on, so zstd bodies reach the decompressor). Runs until
SIGINT/SIGTERM.

    python -m benchmarks.serve_load_server --port P --state-dir D --model tiny --client-config '{...}'
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--api-key", default="tml-bench")
    p.add_argument("--client-config", default="{}")
    p.add_argument("--header-timeout", type=float, default=10.0)
    args = p.parse_args()
    from skyrl_sdk.server import ServerConfig, create_app
    from skyrl_sdk.server.http import edge

    config = ServerConfig(models=(args.model,), state_dir=args.state_dir, port=args.port, api_key=args.api_key,
                          client_config=json.loads(args.client_config), header_timeout_s=args.header_timeout)
    edge.raise_fd_limit()
    edge.Server(edge.server_config(create_app(config), config)).run()


if __name__ == "__main__":
    main()
