"""Starts the real Triton server (the 2.51 binary of PyPI's nvidia-pytriton) on the CPU.

    python -m specdec.launch            # the server alone; Ctrl-C stops it
    python -m specdec.launch --openai   # `make serve`: and the OpenAI-compatible API beside it
    python -m specdec.launch --exit-when-unready   # containers: exit 1 when a stub died

The environment configures it (ports, ENGINE, DEVICE, DTYPE, checkpoints, NUM_SLOTS, ...,
and what locks it: TRITON_INFERENCE_KEY, GRPC_SSL_CERT / GRPC_SSL_KEY; each setting is
declared in specdec/serving/settings.py, the table is in docs/operations.md, Settings). This
module holds the supervisor and the command line; tests and tools start servers with
specdec/harness.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from specdec.processes import descendant_pids, end_with_parent, is_ready, process_alive
from specdec.server_config import ServerConfig, access_summary, memory_fits, server_command

# Triton's own exit timeout (ServerConfig.exit_timeout_s, 30 s) and a margin for unloading.
STOP_GRACE_S = 45.0


def supervise(
    command: list[str],
    env: dict[str, str],
    http_port: int,
    poll_s: float = 5.0,
    max_unready_polls: int = 3,
    stop_grace_s: float = STOP_GRACE_S,
) -> int:
    """Runs tritonserver as a child and passes SIGTERM / SIGINT on. Once the server has been
    ready, a stub process that died, or `max_unready_polls` failed readiness checks in a row,
    stop it and return 1. Triton 2.51 neither restarts a dead Python stub nor stops reporting
    ready (its requests fail), so this process exits and a container restart policy
    (compose `restart: on-failure`) brings up a fresh server. A server that has not exited
    `stop_grace_s` after SIGTERM is killed, stubs and all: with the BLS's stub dead (the
    engines' process), a stream through the ensemble is never released and tritonserver
    hung past its own exit timeout; killed, it closes the streams, so their clients hear."""
    process = subprocess.Popen(command, env=env, preexec_fn=end_with_parent)
    stopping = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    stubs: list[int] = []  # the stub processes, once the server is ready
    misses = 0
    while process.poll() is None:
        time.sleep(poll_s)
        if stopping:
            continue
        ready = is_ready(http_port)
        if ready and not stubs:
            stubs = descendant_pids(process.pid)
        misses = 0 if ready or not stubs else misses + 1
        dead = [pid for pid in stubs if not process_alive(pid)]
        if dead or misses >= max_unready_polls:
            reason = f"stub process {dead[0]} died" if dead else "no longer ready"
            print(f"tritonserver: {reason}; stopping it", file=sys.stderr, flush=True)
            stop(process, stop_grace_s)
            return 1
    return process.returncode


def stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL to it and every process under it after `grace_s` seconds."""
    stubs = descendant_pids(process.pid)
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(
            f"tritonserver: still running {grace_s:.0f} s after SIGTERM; killing it",
            file=sys.stderr,
            flush=True,
        )
        for pid in [process.pid, *stubs]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        process.wait()


def start_openai_api() -> subprocess.Popen:
    """specdec.openai_api as a child: it waits for the server to be ready, reads GRPC_PORT
    and OPENAI_PORT from the environment, and gets SIGTERM when this process ends (or the
    tritonserver that execs in its place)."""
    command = [sys.executable, "-m", "specdec.openai_api"]
    return subprocess.Popen(command, preexec_fn=end_with_parent)


def main() -> None:
    parser = argparse.ArgumentParser(description="Starts tritonserver on the repository.")
    parser.add_argument(
        "--exit-when-unready",
        action="store_true",
        help="supervise the server and exit 1 when it stops being ready (containers)",
    )
    parser.add_argument(
        "--openai",
        action="store_true",
        help="also start the OpenAI-compatible API (specdec.openai_api, OPENAI_PORT)",
    )
    args = parser.parse_args()
    try:
        config = ServerConfig.from_env()
    except ValueError as error:  # a bad setting, named: refused before the server starts
        sys.exit(f"specdec.launch: {error}")
    if not memory_fits(os.environ, 1, config.source_repository):  # its line is on stderr
        sys.exit(2)
    if args.openai:
        start_openai_api()
    print(
        f"tritonserver on {config.address}: HTTP {config.http_port}, gRPC {config.grpc_port}, "
        f"metrics {config.metrics_port}; {access_summary(config)} (Ctrl-C stops it)",
        flush=True,
    )
    command, env = server_command(config)
    if args.exit_when_unready:
        sys.exit(supervise(command, env, config.http_port))
    os.execve(command[0], command, env)  # the server gets Ctrl-C itself and shuts down cleanly


if __name__ == "__main__":
    main()
