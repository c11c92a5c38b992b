"""The `triton` service's command: the image's tritonserver on the rendered repository.

The repository is rendered from the environment exactly as `make serve` does
(specdec/server_config.py; the settings, TARGET_CHECKPOINT, ENGINE, DEVICE, NUM_SLOTS, ..., are
declared in specdec/serving/settings.py: docs/operations.md, Settings),
then /opt/tritonserver/bin/tritonserver serves it on all interfaces of the container
(compose publishes the ports on 127.0.0.1 by default) with model control off and the
repository, shared-memory, trace and logging APIs restricted to requests that carry the
header `admin-key: $TRITON_ADMIN_KEY` (a random key when unset: nobody can call them).
TRITON_INFERENCE_KEY locks inference, metadata, model-config and statistics the same way
(header `inference-key`), and GRPC_SSL_CERT / GRPC_SSL_KEY turn on gRPC TLS; a bad value of
any of them stops the container before tritonserver runs, naming the variable
(docs/operations.md, Security), and so do engines that would not fit the device's free
memory (exit 2; docs/operations.md, Memory). It runs under specdec.launch.supervise: a dead
stub process stops the container (exit 1).
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from pathlib import Path

from specdec.launch import supervise
from specdec.server_config import (
    ServerConfig,
    access_arguments,
    access_summary,
    memory_fits,
    render_repository,
)

TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


def server_command(
    repository: Path, env: dict[str, str], config: ServerConfig | None = None
) -> list[str]:
    """tritonserver's argument list (the first item is the binary). Raises ValueError naming
    the variable for a bad key or TLS file. The admin APIs are always locked: with a random
    key when TRITON_ADMIN_KEY is unset."""
    config = ServerConfig.from_env(env) if config is None else config
    config.admin_key = config.admin_key or secrets.token_hex(16)
    return [
        env.get("TRITONSERVER", TRITONSERVER),
        f"--model-repository={repository}",
        "--model-control-mode=none",
        "--http-port=8000",
        "--grpc-port=8001",
        "--metrics-port=8002",
        *access_arguments(config),
        "--exit-timeout-secs=30",
        f"--log-verbose={env.get('LOG_VERBOSE', '0')}",
        *shlex.split(env.get("TRITON_ARGS", "")),  # e.g. --grpc-use-ssl-mutual=true ...
    ]


def main() -> None:
    env = dict(os.environ)
    try:
        config = ServerConfig.from_env(env)
    except ValueError as error:  # a bad setting, named: refused before the server starts
        sys.exit(f"triton_entrypoint: {error}")
    # Engines too big for the device: one line naming NUM_SLOTS and MAX_CONTEXT, not an
    # out-of-memory error in whichever engine loads second at every restart.
    if not memory_fits(env, 1, config.source_repository):
        sys.exit(2)
    config.run_dir = Path(env.get("RUN_DIR", "/tmp/specdec"))
    repository = render_repository(config)
    command = server_command(repository, env, config)
    print(
        f"tritonserver on {repository} (engine {env.get('ENGINE', 'torch')}; "
        f"{access_summary(config)})",
        flush=True,
    )
    # Supervised: Triton 2.51 keeps answering ready when a Python stub has died, so the
    # supervisor exits 1 when one does, and compose's restart policy brings up a fresh server.
    sys.exit(supervise(command, env, http_port=8000))


if __name__ == "__main__":
    main()
