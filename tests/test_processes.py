"""Ports for our own servers (specdec/processes.py) and what the harness says when a server
cannot start (specdec/harness.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from specdec.harness import ManagedServer
from specdec.processes import free_port


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    """Outgoing connections take their local ports from the ephemeral range, so a port from
    there could be taken while a server loads; two calls must never give the same port."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.server
def test_a_server_that_cannot_start_says_why_in_the_error(target_dir):
    """A taken gRPC port: Triton exits with 1, and the error carries the log's own reason
    (a CI machine's server.log is out of reach)."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        env = {"GRPC_PORT": str(port), "NUM_SLOTS": "4", "MAX_CONTEXT": "512"}
        with pytest.raises(RuntimeError, match="exited with 1") as error:
            ManagedServer("port-taken", env)
    assert f"Socket '127.0.0.1:{port}' already in use" in str(error.value)
