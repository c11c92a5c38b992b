"""Faults: an engine process killed mid-generation, and SIGTERM under load.

Each test starts a server of its own (they end it). Every request must end with a final
response on every path: a lost one hangs its client and the model's unload.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from live import is_final, start_victim, wait_for
from specdec.client import generate
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.processes import descendant_pids, process_alive

pytestmark = pytest.mark.server

# DTYPE: the supervised server reads os.environ too, where `make` exports DTYPE=auto.
SMALL = {"NUM_SLOTS": "8", "MAX_CONTEXT": "512", "DTYPE": "float32"}
BLS, ENSEMBLE = "speculative_decoding", "ensemble"


def streams_under_way(url: str, models: list[str]) -> list:
    """Long streams, one per entry of `models`, each past its start."""
    victims = [
        start_victim(url, f"Write a long story about ship number {i}.", 400, model)
        for i, model in enumerate(models)
    ]
    for _, responses in victims:
        wait_for(lambda responses=responses: len(responses) >= 3)
    return victims


def final_error(responses: list) -> str:
    """The message of the error that ended a stream."""
    finals = [(r, e) for r, e in responses if is_final(r, e)]
    assert len(finals) == 1, f"{len(finals)} final responses"
    _, error = finals[0]
    assert error is not None, "the stream ended without an error"
    return error.message()


def test_a_killed_engines_process_ends_every_request_and_the_supervisor_exits(target_dir):
    # Supervised as in the container (`python -m specdec.launch --exit-when-unready`): Triton
    # does not restart a dead stub, so the supervisor exits 1 and the restart policy acts.
    server = ManagedServer("test-fault-kill", SMALL, supervised=True)
    try:
        victims = streams_under_way(server.url, [BLS, BLS, BLS, ENSEMBLE])
        os.kill(server.stub_pid(BLS), signal.SIGKILL)  # the engines live in its process
        for client, responses in victims:
            # Nobody is left to send a final response: the supervisor stops the server (and
            # kills it once its exit timeout has passed), which ends each stream with an error.
            wait_for(lambda responses=responses: any(is_final(r, e) for r, e in responses), 120)
            final_error(responses)
            client.close()
        later = generate("Hello", url=server.url, model="speculative_decoding", max_tokens=4)
        assert later.error is not None  # the engine is gone, or the server with it
        # Triton 2.51 keeps answering ready with a dead stub: the supervisor sees the stub
        # gone, stops the server (readiness false) and exits 1 for the restart policy.
        assert server.process.wait(timeout=120) == 1
        assert not server.ready
    finally:
        server.stop()


@pytest.mark.parametrize("response_thread", ["false", "true"])
def test_sigterm_under_load_ends_every_stream_within_the_exit_timeout(target_dir, response_thread):
    # Through the ensemble too: a stream there used to get no final response at all (a step
    # after the BLS was refused once the server stopped, and Triton 2.51's ensemble then
    # dropped the BLS's final error) and held the server's exit; see the ensemble config.
    # With the response thread, finalize() must still send what it queued before it returns.
    server = ManagedServer("test-fault-sigterm", {**SMALL, "RESPONSE_THREAD": response_thread})
    try:
        victims = streams_under_way(server.url, [BLS, BLS, ENSEMBLE, ENSEMBLE])
        server.process.send_signal(signal.SIGTERM)
        for _, responses in victims:
            wait_for(
                lambda responses=responses: any(is_final(r, e) for r, e in responses),
                server.config.exit_timeout_s + 15,
            )
        for client, responses in victims:
            # Triton lets requests in flight finish within its exit timeout: the engines are
            # in the BLS's process, so a stream either completes or, once the timeout has
            # passed and the BLS is unloaded, ends with an error that says so; never with a
            # dropped connection.
            finals = [(r, e) for r, e in responses if is_final(r, e)]
            assert len(finals) == 1, f"{len(finals)} final responses"
            error = finals[0][1]
            if error is not None:
                assert "shutting down" in error.message(), error.message()
            client.close()
        server.process.wait(timeout=server.config.exit_timeout_s + 30)
    finally:
        server.stop()


def test_a_server_ends_when_the_process_that_started_it_is_killed(target_dir):
    # A benchmark killed outright (SIGKILL, an OOM kill) must not leave its server running:
    # a stray server takes the CPU from the next measurement.
    script = (
        "from specdec.harness import ManagedServer\n"
        "import time\n"
        f"server = ManagedServer('orphan-check', {SMALL!r})\n"
        "print(server.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT
    )
    server_pid = int(owner.stdout.readline())
    stubs = descendant_pids(server_pid)
    assert process_alive(server_pid) and stubs
    owner.kill()
    owner.wait()
    try:
        wait_for(lambda: not any(process_alive(p) for p in [server_pid, *stubs]), timeout=90)
    finally:  # a failure must not leave the server running for the tests after it
        for pid in [server_pid, *stubs]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
