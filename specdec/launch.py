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
from collections.abc import Sequence
from contextlib import suppress

from specdec.processes import (
    descendant_pids,
    end_with_parent,
    is_ready,
    process_alive,
    terminate,
)
from specdec.server_config import ServerConfig, access_summary, memory_fits, server_command

# The container's tritonserver has an exit timeout of 30 s (docker/triton_entrypoint.py); this
# adds a margin for unloading. The launcher's own servers stop sooner (ServerConfig.stop_s).
STOP_GRACE_S = 45.0
# How often the supervisor looks at its children; readiness is asked every `poll_s`.
WATCH_S = 0.2


def supervise(
    command: list[str],
    env: dict[str, str],
    http_port: int,
    poll_s: float = 5.0,
    max_unready_polls: int = 3,
    stop_grace_s: float = STOP_GRACE_S,
    exit_when_unready: bool = True,
    companions: Sequence[subprocess.Popen] = (),
    signalled: list[int] | None = None,
) -> int:
    """Runs tritonserver as a child beside `companions` (the OpenAI API) and passes SIGTERM /
    SIGINT on to all of them; returns 0 once they have stopped on one. A child that exits
    on its own stops the others, and its exit status is returned. exit_when_unready: once
    the server has been ready, a stub process that died, or `max_unready_polls` failed
    readiness checks in a row, stop it and return 1. Triton 2.51 neither restarts a dead
    Python stub nor stops reporting ready (its requests fail), so this process exits and a
    container restart policy (compose `restart: on-failure`) brings up a fresh server. A
    server that has not exited `stop_grace_s` after SIGTERM is killed, stubs and all: with
    the BLS's stub dead (the engines' process), a stream through the ensemble is never
    released and tritonserver hung past its own exit timeout; killed, it closes the
    streams, so their clients hear. signalled: the list that the caller's own handlers fill
    until these take over; a signal that came meanwhile is passed on at once."""
    # A session of its own: the terminal's Ctrl-C reaches this process, which passes it on,
    # and not Triton's Python stubs, where it interrupted whatever they were importing.
    process = subprocess.Popen(command, env=env, preexec_fn=end_with_parent, start_new_session=True)
    children = [process, *companions]
    signalled = [] if signalled is None else signalled  # the caller's handlers append to it

    def pass_on() -> None:
        # SIGTERM whichever came: after Ctrl-C the children have had SIGINT from the terminal
        # too, and a second SIGINT tells uvicorn to stop without waiting for its streams.
        for child in children:
            if child.poll() is None:
                child.terminate()

    def forward(signum, _frame) -> None:
        signalled.append(signum)
        pass_on()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if signalled:  # one came while the children started, before these handlers
        pass_on()
    stubs: list[int] = []  # the stub processes, once the server is ready
    misses, next_poll = 0, time.monotonic() + poll_s
    while not signalled and all(child.poll() is None for child in children):
        time.sleep(WATCH_S)
        if not exit_when_unready or time.monotonic() < next_poll or signalled:
            continue
        next_poll = time.monotonic() + poll_s
        ready = is_ready(http_port)
        if ready and not stubs:
            stubs = descendant_pids(process.pid)
        misses = 0 if ready or not stubs else misses + 1
        dead = [pid for pid in stubs if not process_alive(pid)]
        if dead or misses >= max_unready_polls:
            reason = f"stub process {dead[0]} died" if dead else "no longer ready"
            print(f"tritonserver: {reason}; stopping it", file=sys.stderr, flush=True)
            if stop(process, stop_grace_s):
                print(
                    f"tritonserver: still running {stop_grace_s:.0f} s after SIGTERM; killed it",
                    file=sys.stderr,
                    flush=True,
                )
            _end_all(companions)
            return 1
    ended = next((child for child in children if child.poll() is not None), None)
    if stop(process, stop_grace_s, already_signalled=bool(signalled)) and signalled:
        # Every stream has had its final response by now (ServerConfig.drain_s): a client
        # that keeps its stream open holds Triton 2.51 until its exit timeout, which ends it
        # with an error. Not a fault of this server's.
        print(
            f"tritonserver: still stopping {stop_grace_s:g} s after the signal (clients "
            "keep streams open); ended it",
            flush=True,
        )
    _end_all(companions)
    if signalled or ended is None:
        return 0
    return ended.returncode if ended.returncode >= 0 else 1  # < 0: a signal ended it


def stop(process: subprocess.Popen, grace_s: float, already_signalled: bool = False) -> bool:
    """SIGTERM (unless it has had a signal already), then SIGKILL after `grace_s` seconds;
    what is left of its process group then (its Python stubs) is killed too. Returns whether
    tritonserver itself had to be killed."""
    killed = terminate(process, grace_s, signalled=already_signalled)
    # Killed by SIGTERM while it loads its models (its handler comes after), Triton leaves
    # its stubs running, orphaned: they share its process group (supervise's session).
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    return killed


def _end_all(companions: Sequence[subprocess.Popen], timeout: float = 5.0) -> None:
    """The companions stopped (SIGTERM, then SIGKILL): they exit promptly on a signal."""
    for companion in companions:
        terminate(companion, timeout)


def start_openai_api() -> subprocess.Popen:
    """specdec.openai_api as a child: it waits for the server to be ready, reads GRPC_PORT
    and OPENAI_PORT from the environment, and gets SIGTERM when this process ends."""
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
    early: list[int] = []  # a signal before the server runs: stop there, quietly
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: early.append(signum))
    if not memory_fits(os.environ, 1, config.source_repository):  # its line is on stderr
        sys.exit(2)
    command, env = server_command(config)
    if early:
        sys.exit(0)
    print(
        f"tritonserver on {config.address}: HTTP {config.http_port}, gRPC {config.grpc_port}, "
        f"metrics {config.metrics_port}; {access_summary(config)} (Ctrl-C stops it)",
        flush=True,
    )
    companions = [start_openai_api()] if args.openai else []
    sys.exit(
        supervise(
            command,
            env,
            config.http_port,
            stop_grace_s=config.stop_s,
            exit_when_unready=args.exit_when_unready,
            companions=companions,
            signalled=early,
        )
    )


if __name__ == "__main__":
    main()
