"""Process and port utilities for starting and watching servers: a free loopback port, an open
port, Triton's readiness, and Linux /proc reads (descendants, liveness, resident memory).

Used by the harness (specdec/harness.py), the supervisor (specdec/launch.py) and the gateway.
"""

from __future__ import annotations

import ctypes
import random
import re
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM when the process that
    started it dies, so a benchmark or test killed outright leaves no server behind to slow
    the next measurement down. Linux; elsewhere nothing happens."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def terminate(process: subprocess.Popen, timeout: float, signalled: bool = False) -> bool:
    """SIGTERM (unless `signalled`: it has had one), then SIGKILL if it has not exited within
    `timeout` seconds; reaps it. Returns whether it had to be killed."""
    if process.poll() is not None:
        return False
    if not signalled:
        process.terminate()
    try:
        process.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return True


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range and never
    handed out before by this process. A port from bind(0) is an ephemeral one: the
    connections a test or a server opens while the server loads (readiness polls, metrics
    scrapes) draw their local ports from that same range and could take it first, and two
    calls could return the same port; either made a server exit with 1 before it was up."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low <= 11000:  # no room below the ephemeral range: the kernel's choice, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.randrange(10000, low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free loopback port in 10000-{low - 1}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def is_ready(http_port: int, host: str = "127.0.0.1") -> bool:
    """Triton's readiness: every model loaded and its stub alive."""
    try:
        url = f"http://{host}:{http_port}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:  # HTTPError (503: not ready) is an OSError too
        return False


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None once it has ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendant_pids(parent: int) -> list[int]:
    """Children, grandchildren, ... of a process (Linux /proc, read once)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(entry.name)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [parent]
    while frontier:
        frontier = [c for p in frontier for c in children.get(p, [])]
        found += frontier
    return found


def process_alive(pid: int) -> bool:
    """Running (a killed child that its parent has not reaped yet is a zombie: not alive)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def resident_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def tree_resident_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants."""
    return sum(resident_bytes(p) for p in [pid, *descendant_pids(pid)])
