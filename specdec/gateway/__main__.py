"""The gateway's command line: `python -m specdec.gateway serve | compose | drain |
kubernetes-config | compose-config` (specdec/gateway/__init__.py lists what each does).
"""

from __future__ import annotations

import argparse
import os
import sys

from specdec.gateway.config import render_compose_config, render_kubernetes_config
from specdec.gateway.drain import drain
from specdec.gateway.serve import compose, serve

DESCRIPTION = (
    "Several Triton replicas behind one L7 gRPC gateway: HAProxy, configured and run by us."
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.gateway", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("serve", help="N replicas behind the gateway (default)")
    run.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", 2)))
    run.add_argument("--openai", action="store_true", help="and the OpenAI-compatible API")
    commands.add_parser("compose", help="in compose's gateway container: check, then HAProxy")
    stop = commands.add_parser("drain", help="preStop: settle, then wait until idle")
    stop.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    stop.add_argument("--settle-seconds", type=float, default=10.0)
    stop.add_argument("--timeout-seconds", type=float, default=300.0)
    commands.add_parser("kubernetes-config", help="print the gateway's haproxy.cfg for pods")
    commands.add_parser("compose-config", help="print the gateway's haproxy.cfg for compose")
    args = parser.parse_args()
    if args.command == "drain":
        idle = drain(args.metrics_url, args.settle_seconds, args.timeout_seconds)
        print("idle" if idle else "still busy at the timeout", flush=True)
    elif args.command == "compose":
        sys.exit(compose(dict(os.environ)))
    elif args.command == "kubernetes-config":
        print(render_kubernetes_config(), end="")
    elif args.command == "compose-config":
        print(render_compose_config(), end="")
    else:
        replicas = getattr(args, "replicas", int(os.environ.get("REPLICAS", 2)))
        sys.exit(serve(replicas, dict(os.environ), openai=getattr(args, "openai", False)))


if __name__ == "__main__":
    main()
