"""`make serve` stops on SIGINT or SIGTERM at every moment of its life: every process it
started ends within 10 s, the launcher exits 0, nothing is left listening and nothing
printed after the signal is an error or a traceback.

Each test runs `python -m specdec.launch --openai` (what `make serve` runs) in a session of
its own, small (8 slots: one per stream of the load test; no start-up measurement), and
signals it at one moment: while the models load, once Triton is ready but before the
OpenAI API listens, idle, and under load with gRPC streams to Triton and HTTP streams
through the OpenAI API and to Triton's own HTTP endpoint open (each must get its final
response or error, not hang). Ctrl-C is SIGINT to the whole process group (the terminal
sends it to every process); `kill` and make's forwarding reach the launcher alone. One
more: a Triton that fails to start takes the OpenAI API with it.

`SIGNALS_REPLICAS=2 pytest tests/test_signals.py` runs the same tests against `make serve
REPLICAS=2` (the gateway, specdec/gateway/serve.py; HAProxy needed): two servers at once, so
not part of `make test` (docs/testing.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from live import is_final, start_victim, wait_for
from specdec.paths import PROJECT_ROOT
from specdec.processes import descendant_pids, free_port, is_ready, port_open, process_alive

pytestmark = pytest.mark.server

REPLICAS = int(os.environ.get("SIGNALS_REPLICAS", "1"))
# float32 as the committed configs (make exports DTYPE=auto); no start-up measurement.
SMALL = {"NUM_SLOTS": "8", "MAX_CONTEXT": "256", "DTYPE": "float32", "CALIBRATION_SECONDS": "0"}
STOP_S = 10.0
BLS = "speculative_decoding"
# What must not appear in any output of a stop: a traceback, Triton's error lines
# ("E1207 ..."), uvicorn's and Python's logged errors, the supervisor killing a server.
ERROR_LINE = re.compile(r"Traceback|^E\d{4} |^ERROR|Error:|killing it|failed to stop", re.M)


class Serve:
    """`make serve` (REPLICAS=1: specdec.launch --openai; else the gateway) on free ports,
    in a process group of its own, its output in files under .run/<name>."""

    def __init__(self, name: str, replicas: int, taken_grpc_port: int | None = None):
        names = ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "GATEWAY_STATS_PORT")
        self.ports = {name: free_port() for name in names}
        if taken_grpc_port is not None:
            self.ports["GRPC_PORT"] = taken_grpc_port
        run_dir = PROJECT_ROOT / ".run" / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a replica's log is appended to
        run_dir.mkdir(parents=True)
        settings = {**SMALL, **{k: str(v) for k, v in self.ports.items()}, "RUN_DIR": str(run_dir)}
        if replicas == 1:
            command = [sys.executable, "-m", "specdec.launch", "--openai"]
        else:
            base = free_port()  # replica i: base + 10 i, + 1, + 2 (specdec/gateway/serve.py)
            settings["REPLICA_BASE_PORT"] = str(base)
            replica_ports = [base + 10 * i + j for i in range(replicas) for j in range(3)]
            self.ports.update({f"replica port {p}": p for p in replica_ports})
            command = [sys.executable, "-m", "specdec.gateway", "serve", "--openai"]
            command += ["--replicas", str(replicas)]
        out_path, err_path = run_dir / "stdout", run_dir / "stderr"
        # What it prints, and its replicas' logs (the gateway writes those to files).
        replica_logs = [run_dir / f"replica{i}" / "server.log" for i in range(replicas)]
        self.logs = [out_path, err_path, *(replica_logs if replicas > 1 else [])]
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **settings},
                stdout=out,
                stderr=err,
                cwd=PROJECT_ROOT,
                start_new_session=True,  # its own process group, as a terminal's job
            )

    @property
    def ready(self) -> bool:
        return is_ready(self.ports["HTTP_PORT"])

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['OPENAI_PORT']}/v1"

    def wait_until(self, condition, timeout: float = 300.0, poll_s: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, f"exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"not reached in {timeout} s:\n{self.output()}"
            time.sleep(poll_s)

    def processes(self) -> set[int]:
        """Every live process of its group, and every descendant of the launcher."""
        pids = {self.process.pid, *descendant_pids(self.process.pid)}
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if os.getpgid(int(entry.name)) == self.process.pid:
                    pids.add(int(entry.name))
            except OSError:  # ended meanwhile
                continue
        return {pid for pid in pids if process_alive(pid)}

    def log_sizes(self) -> list[int]:
        return [path.stat().st_size if path.exists() else 0 for path in self.logs]

    def output(self, since: list[int] | None = None) -> str:
        """Its logs, each from byte `since[i]` on (default: whole)."""
        starts = since or [0] * len(self.logs)
        return "".join(
            path.read_bytes()[start:].decode(errors="replace")
            for path, start in zip(self.logs, starts, strict=True)
            if path.exists()
        )

    def stop_with(self, signum: int, whole_group: bool) -> float:
        """Sends `signum` (to the process group: Ctrl-C; else the launcher alone) and checks
        the stop; returns the seconds until the last process had ended."""
        started = self.processes()
        before = self.log_sizes()  # Triton's start says "E... CudaDriverHelper" on a CPU
        sent = time.monotonic()
        if whole_group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            pytest.fail(f"still running {STOP_S} s after {signum!r}:\n{self.output()}")
        wait_for(lambda: not [p for p in self.processes() | started if process_alive(p)], 1.0)
        seconds = time.monotonic() - sent
        print(f"{signal.Signals(signum).name}: every process ended in {seconds:.1f} s")
        assert code == 0, self.output()
        assert seconds < STOP_S
        assert [p for p, port in self.ports.items() if port_open(port)] == []
        assert not ERROR_LINE.search(self.output(since=before)), self.output()
        return seconds

    def kill(self) -> None:
        """The fallback of a failed test: nothing of it may slow the next one down."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def serve(request, target_dir):
    started: list[Serve] = []

    def start(replicas: int = REPLICAS, taken_grpc_port: int | None = None) -> Serve:
        started.append(Serve(f"test-signals-{request.node.name}", replicas, taken_grpc_port))
        return started[-1]

    yield start
    for served in started:
        served.kill()


def test_ctrl_c_while_the_models_load(serve):
    # The engine models are loaded, the BLS's stub is still loading its engines.
    served = serve()
    served.wait_until(lambda: "successfully loaded 'draft_model'" in served.output())
    assert not served.ready
    served.stop_with(signal.SIGINT, whole_group=True)


def test_sigterm_once_triton_is_ready_before_the_openai_api_listens(serve):
    # The OpenAI API waited for a Triton that was gone, catching SIGTERM meanwhile.
    served = serve()
    served.wait_until(lambda: served.ready, poll_s=0.02)
    assert not port_open(served.ports["OPENAI_PORT"])  # the moment this test is about
    served.stop_with(signal.SIGTERM, whole_group=False)


def test_sigint_to_the_launcher_when_idle(serve):
    served = serve()
    served.wait_until(lambda: port_open(served.ports["OPENAI_PORT"]))
    served.stop_with(signal.SIGINT, whole_group=False)


def read_sse(url: str, body: dict, events: list[str]) -> None:
    """Reads a server-sent-event stream into `events`, one `data:` payload each."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            for line in response:
                if line.strip():
                    events.append(line.decode().strip().removeprefix("data: "))
    except OSError as error:  # cut off: the test sees no [DONE]
        events.append(f"cut off: {error}")


def test_ctrl_c_under_load_ends_every_stream_first(serve):
    # With streams open, Triton used to count its 30 s exit timeout down (HTTP connections,
    # then gRPC streams that their clients keep open), and the OpenAI API to wait for its
    # streams. Now every stream gets its final response or error, then everything ends.
    served = serve()
    served.wait_until(lambda: port_open(served.ports["OPENAI_PORT"]))
    grpc_url = f"127.0.0.1:{served.ports['GRPC_PORT']}"
    victims = [start_victim(grpc_url, f"Write a long story about ship {i}.", 200) for i in (1, 2)]
    model = json.load(urllib.request.urlopen(f"{served.openai_url}/models"))["data"][0]["id"]
    triton_http = f"http://127.0.0.1:{served.ports['HTTP_PORT']}/v2/models/{BLS}/generate_stream"
    long_story = {"max_tokens": 200, "stream": True}
    streams = [  # (url, body): through the OpenAI API, and to Triton's own HTTP endpoint
        (f"{served.openai_url}/completions", {**long_story, "model": model, "prompt": "Tell me"}),
        (f"{served.openai_url}/completions", {**long_story, "model": model, "prompt": "Write"}),
        (triton_http, {**long_story, "text_input": "Tell me a story.", "end_id": -1}),
        (triton_http, {**long_story, "text_input": "Write a story.", "end_id": -1}),
    ]
    events: list[list[str]] = [[] for _ in streams]
    readers = [
        threading.Thread(target=read_sse, args=(url, body, into))
        for (url, body), into in zip(streams, events, strict=True)
    ]
    for reader in readers:
        reader.start()
    for _, responses in victims:
        wait_for(lambda responses=responses: len(responses) >= 2, 120)
    wait_for(lambda: all(len(into) >= 2 for into in events), 120)
    served.stop_with(signal.SIGINT, whole_group=True)
    for client, responses in victims:
        # The server's own final response first; a stream its client keeps open then ends
        # with the server (an error of the closed connection).
        error = next(e for r, e in responses if is_final(r, e))
        assert error is None or "shutting down" in error.message(), error.message()
        client.close()
    for reader in readers:
        reader.join(timeout=5)
    for into in events[:2]:  # OpenAI: an error event (or the end), then [DONE]
        assert into[-1] == "[DONE]", into[-3:]
        assert "error" not in into[-2] or "shutting down" in into[-2], into[-3:]
    for into in events[2:]:  # Triton's: its final error, then the end of the response
        assert "shutting down" in into[-1], into[-3:]


def test_a_triton_that_cannot_start_takes_the_openai_api_with_it(serve):
    # The launcher's own path (REPLICAS=1 whatever SIGNALS_REPLICAS says). Its gRPC port
    # taken, Triton loads its models, then exits 1; the OpenAI API, waiting for it, stayed.
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        served = serve(replicas=1, taken_grpc_port=port)
        assert served.process.wait(timeout=300) == 1
        wait_for(lambda: not served.processes(), STOP_S)
    assert "already in use" in served.output()
    assert not port_open(served.ports["OPENAI_PORT"])
