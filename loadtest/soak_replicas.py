"""Soak of two replicas behind the gateway (issue 52, part 4): mixed load for `--duration`
seconds (default 30 minutes) while one replica is killed and started again. It fails unless
every request is accounted for and none failed, every KV slot of the surviving replica is
free at the end, and no process that lived throughout grew by more than 5% after the warm-up.

    .venv/bin/python loadtest/soak_replicas.py --duration 1800 --concurrency 8  # make soak-replicas

Servers. It runs `python -m specdec.gateway serve --replicas 2 --openai`, the command behind
`make serve REPLICAS=2` (with DTYPE=auto where unset, as make sets it), in a session of its
own, on free loopback ports (GRPC_PORT, HTTP_PORT, GATEWAY_STATS_PORT, OPENAI_PORT,
REPLICA_BASE_PORT) with its run folder in .run/<name>; at the end it sends the session
SIGINT, as Ctrl-C does, and the launcher must exit 0. Each replica is a supervisor
(`specdec.launch --exit-when-unready`) over a tritonserver, which is found among the
launcher's descendants by its `--http-port`. The restart is the launcher's own: at
`--kill-at` seconds (default: half the duration) replica1's tritonserver gets SIGKILL, its
supervisor kills the stubs and exits 1, and `serve` starts replica1 again on the same ports.
Meanwhile the gateway takes it out of the rotation and replica0 carries the whole load.

Load. `--concurrency` workers send one request at a time, each on a gRPC stream (or HTTP
request) of its own so that the gateway balances every request. Each worker cycles through
MIX:
- chat, grounded: streamed through `ensemble`, with soak.py's REQUEST_MIX (greedy adaptive,
  k = 2, seeded sampling, a stop word) over the chat and grounded prompt files;
- openai-complete, openai-disconnect: streamed chat completions on the OpenAI API (the
  `openai` package), read to the end, or closed after 1-4 chunks;
- grpc-cancel: streamed to `speculative_decoding` and cancelled after 1-5 chunks (an
  ensemble step never hears of a cancellation; the BLS does);
- bad-input-grpc, bad-input-openai: BAD_GRPC and BAD_OPENAI, each refused with a message
  that must name its field.

The ledger. Each request ends as exactly one of OUTCOMES:
- completed: exactly one final response. gRPC: a response flagged final, and nothing more
  on the stream once the server has closed it. OpenAI: exactly one chunk with a
  finish_reason.
- refused-retryable: nothing was served, and sending the request again can succeed. That is
  the server's "queue full" or "server is shutting down" at any time. Inside the kill
  window (from the kill until WINDOW_GRACE_S after the restarted replica is back in the
  gateway's rotation) it is also: gRPC UNAVAILABLE; HAProxy's reset of a stream that was on
  the dead replica, or put on its connection as it died (tritonclient: "Stream removed (...
  RST_STREAM ...)", status CANCELLED, INTERNAL or UNAVAILABLE); the OpenAI API's 503 or its
  error event "Triton unavailable". Outside the window these errors are failures, because
  no replica should be down then.
- cancelled-by-client: the client cancelled the request or closed the stream before the
  final response.
- rejected-bad-input: a bad request refused with a message that names its field.
- failed: anything else. That includes an error, a bad value served or refused without
  naming its field, no final response within REQUEST_TIMEOUT_S, a response after the final
  one, and a worker that never came back. This count must be 0.

At the end, each live replica is scraped once it is idle: replica0's free KV slots must equal
NUM_SLOTS. The resident memory of each process that lived throughout (the launcher, HAProxy,
the OpenAI API, replica0's supervisor and its tritonserver with its stubs) is sampled every
min(30, duration / 60) s. Its growth is the largest sample after the warm-up (the issue's
5 minutes, scaled to min(300, duration / 6) s for shorter runs) over the last sample of the
warm-up, as soak.py judges it. Writes <out-dir>/<name>.json, prints a summary, and exits 1
when any check fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import openai
from tritonclient.utils import InferenceServerException

from common import WORKLOADS, Message, load_prompts, parse_env, prompt_messages
from soak import REQUEST_MIX, SoakConfig, SoakResult, judge_memory
from specdec.client import StreamingClient, scrape_metrics, wait_until_idle
from specdec.gateway.config import GRPC_BACKENDS, Replica
from specdec.gateway.serve import replica_ports, server_states
from specdec.openai_api.protocol import OVERLOADED
from specdec.paths import PROJECT_ROOT
from specdec.processes import (
    descendant_pids,
    end_with_parent,
    free_port,
    is_ready,
    port_open,
    process_alive,
    resident_bytes,
    tree_resident_bytes,
)
from specdec.serving import settings
from specdec.serving.metric_names import CALIBRATED, REQUESTS

NUM_REPLICAS = 2
SURVIVOR, VICTIM = 0, 1  # replica indices
REQUEST_TIMEOUT_S = 300.0  # a hang detector: no request waits this long for its final response
START_TIMEOUT_S = 900.0  # two replicas loading on the same cores
STOP_TIMEOUT_S = 120.0  # each replica stops within its own grace (specdec/launch.py)
IDLE_TIMEOUT_S = 120.0
WINDOW_GRACE_S = 10.0  # gRPC and the OpenAI API may report a reset a moment late
POLL_S = 0.5

COMPLETED, REFUSED, CANCELLED = "completed", "refused-retryable", "cancelled-by-client"
REJECTED, FAILED = "rejected-bad-input", "failed"
OUTCOMES = (COMPLETED, REFUSED, CANCELLED, REJECTED, FAILED)
LOST = "lost-with-replica"  # provisional: REFUSED inside the kill window, FAILED outside

MIX = (
    "chat",
    "grounded",
    "openai-disconnect",
    "grpc-cancel",
    "chat",
    "grounded",
    "openai-complete",
    "bad-input-grpc",
    "bad-input-openai",
)
# (the field the refusal must name, the request's inputs that are wrong)
BAD_GRPC: tuple[tuple[str, dict[str, Any]], ...] = (
    ("max_tokens", {"max_tokens": -1}),
    ("proposer", {"proposer": "eagle"}),  # no such proposer
    ("top_p", {"top_p": 1.5}),
    ("num_draft_tokens", {"num_draft_tokens": -1}),
)
BAD_OPENAI: tuple[tuple[str, dict[str, Any]], ...] = (
    ("max_tokens", {"max_tokens": -1}),
    ("temperature", {"temperature": -1.0}),
    ("no_such_field", {"extra_body": {"no_such_field": 1}}),
)


@dataclass
class ReplicasSoakConfig:
    duration_s: float = 1800.0
    concurrency: int = 8
    max_tokens: int = 64
    kill_at_s: float | None = None  # None: half the duration
    max_growth: float = 0.05
    restart_timeout_s: float = 900.0  # from the kill until the replica is back
    server_env: dict[str, str] = field(default_factory=dict)
    name: str = "soak-replicas"
    out_dir: Path = PROJECT_ROOT / "results"

    @property
    def warmup_s(self) -> float:
        """The issue's 5-minute mark, scaled down for shorter runs."""
        return min(300.0, self.duration_s / 6)

    @property
    def sample_every_s(self) -> float:
        return min(30.0, max(1.0, self.duration_s / 60))

    @property
    def kill_s(self) -> float:
        return self.duration_s / 2 if self.kill_at_s is None else self.kill_at_s


# -- the servers -----------------------------------------------------------------------------
@dataclass
class Layout:
    """The launcher's ports: the gateway's, the OpenAI API's, and each replica's."""

    grpc_port: int
    http_port: int
    stats_port: int
    openai_port: int
    replica_base: int
    replicas: list[Replica]

    @classmethod
    def on_free_ports(cls) -> Layout:
        grpc, http, stats, openai_port = ports = [free_port() for _ in range(4)]
        base = free_replica_base(NUM_REPLICAS, taken=ports)
        replicas = [replica_ports(i, base) for i in range(NUM_REPLICAS)]
        return cls(grpc, http, stats, openai_port, base, replicas)

    def env(self) -> dict[str, str]:
        ports = {
            "GRPC_PORT": self.grpc_port,
            "HTTP_PORT": self.http_port,
            "GATEWAY_STATS_PORT": self.stats_port,
            "OPENAI_PORT": self.openai_port,
            "REPLICA_BASE_PORT": self.replica_base,
        }
        return {name: str(port) for name, port in ports.items()}


def free_replica_base(num_replicas: int, taken: list[int]) -> int:
    """A REPLICA_BASE_PORT whose replicas' ports (base + 10 i, + 1, + 2) are free."""
    for _ in range(100):
        base = free_port()
        ports = [base + 10 * i + j for i in range(num_replicas) for j in range(3)]
        if not set(ports) & set(taken) and not any(port_open(p) for p in ports):
            return base
    raise OSError("no free run of loopback ports for the replicas")


def metrics_url(replica: Replica) -> str:
    return f"http://127.0.0.1:{replica.metrics_port}/metrics"


def start_launcher(layout: Layout, env: dict[str, str], run_dir: Path) -> subprocess.Popen:
    """`make serve REPLICAS=2`'s command, in a session of its own: the soak's own Ctrl-C does
    not reach it (the soak stops it, and checks how it exits); end_with_parent: a soak
    killed outright still stops it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "specdec.gateway", "serve"]
    command += ["--replicas", str(NUM_REPLICAS), "--openai"]
    with open(run_dir / "launcher.log", "wb") as log:  # launcher_restarts reads this run's
        return subprocess.Popen(
            command,
            env={**env, **layout.env(), "RUN_DIR": str(run_dir)},
            cwd=PROJECT_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=end_with_parent,
        )


def replica_serving(layout: Layout, replica: Replica) -> bool:
    """Ready, its start-up cost measurement over, and UP in both of the gateway's gRPC
    backends (each checks it on its own)."""
    try:
        return (
            is_ready(replica.http_port)
            and scrape_metrics(metrics_url(replica)).get(CALIBRATED) == 1.0
            and all(
                server_states(layout.stats_port, b).get(replica.name) == "UP" for b in GRPC_BACKENDS
            )
        )
    except OSError:
        return False


def openai_up(layout: Layout) -> bool:
    try:
        url = f"http://127.0.0.1:{layout.openai_port}/health"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_serving(launcher: subprocess.Popen, layout: Layout, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (all(replica_serving(layout, r) for r in layout.replicas) and openai_up(layout)):
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited with {launcher.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not serving after {START_TIMEOUT_S:.0f} s; see {log}")
        time.sleep(1.0)


def stop_launcher(launcher: subprocess.Popen) -> int:
    """SIGINT to its session, as Ctrl-C under `make serve` sends it: the launcher passes
    SIGTERM on to the replicas and the OpenAI API and waits for them. Its exit status; after
    STOP_TIMEOUT_S the session is killed instead (then -9)."""
    if launcher.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGINT)
    try:
        return launcher.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        return launcher.wait()


def launcher_restarts(log: Path) -> list[str]:
    """The replicas that `serve` started again, in order, from its log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return re.findall(r"^(replica\d+) exited \(-?\d+\); starting it again", text, re.MULTILINE)


# -- the processes -------------------------------------------------------------------------
def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def find_descendant(root: int, matches: Callable[[list[str]], bool]) -> int | None:
    """The first descendant of `root` whose command line (never empty) `matches`."""
    return next(
        (p for p in descendant_pids(root) if (argv := command_line(p)) and matches(argv)), None
    )


def replica_processes(launcher_pid: int, replica: Replica) -> tuple[int, int] | None:
    """(the replica's supervisor, its tritonserver), or None while it has none."""
    flag = f"--http-port={replica.http_port}"
    triton = find_descendant(launcher_pid, lambda a: a[0].endswith("tritonserver") and flag in a)
    if triton is None:
        return None
    for pid in descendant_pids(launcher_pid):
        if "specdec.launch" in command_line(pid) and triton in descendant_pids(pid):
            return pid, triton
    return None


@dataclass
class Tracked:
    """A process that must live throughout, and its resident memory: (seconds, bytes)."""

    name: str
    pid: int
    tree: bool  # with its descendants (tritonserver: its stub processes)
    samples: list[tuple[float, int]] = field(default_factory=list)

    def sample(self, at_s: float) -> None:
        if process_alive(self.pid):
            measure = tree_resident_bytes if self.tree else resident_bytes
            self.samples.append((round(at_s, 1), measure(self.pid)))


def lived_throughout(launcher_pid: int, layout: Layout) -> list[Tracked]:
    """The processes that should live throughout: all but the victim's."""
    gateway = find_descendant(launcher_pid, lambda a: a[0].endswith("haproxy"))
    openai_api = find_descendant(launcher_pid, lambda a: "specdec.openai_api" in a)
    survivor = replica_processes(launcher_pid, layout.replicas[SURVIVOR])
    if gateway is None or openai_api is None or survivor is None:
        raise RuntimeError("the launcher's gateway, OpenAI API or replica0 not found")
    name = layout.replicas[SURVIVOR].name
    return [
        Tracked("launcher", launcher_pid, tree=False),
        Tracked("gateway", gateway, tree=False),
        Tracked("openai_api", openai_api, tree=True),
        Tracked(f"{name}_supervisor", survivor[0], tree=False),
        Tracked(f"{name}_tritonserver", survivor[1], tree=True),
    ]


def sample_memory(tracked: list[Tracked], clock: Clock, every_s: float, done: threading.Event):
    while True:
        at_s = clock.now()
        for process in tracked:
            process.sample(at_s)
        if done.wait(every_s):
            break
    for process in tracked:  # the end of the load
        process.sample(clock.now())


def memory_report(process: Tracked, config: ReplicasSoakConfig) -> dict:
    judged = SoakResult(memory=process.samples)
    judge_memory(judged, SoakConfig(warmup_s=config.warmup_s))
    return {
        "pid": process.pid,
        "lived_throughout": process_alive(process.pid),
        "warmup_bytes": judged.warmup_bytes,
        "peak_after_warmup_bytes": judged.peak_after_warmup_bytes,
        "growth": judged.growth,
        "samples": process.samples,
    }


# -- the ledger ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start


@dataclass
class Request:
    kind: str
    started_s: float
    ended_s: float | None = None
    outcome: str | None = None  # one of OUTCOMES (or LOST, until settled)
    detail: str = ""


class Ledger:
    """Every request sent, each with its outcome once it has one."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.requests: list[Request] = []
        self.lock = threading.Lock()

    def open(self, kind: str) -> Request:
        request = Request(kind, round(self.clock.now(), 2))
        with self.lock:
            self.requests.append(request)
        return request

    def close(self, request: Request, outcome: str, detail: str) -> None:
        request.ended_s = round(self.clock.now(), 2)
        request.outcome, request.detail = outcome, detail


def settle(requests: list[Request], window: tuple[float, float]) -> None:
    """The provisional outcomes made final: LOST inside the kill window is REFUSED, outside
    it FAILED; a request without an outcome (its worker never came back) FAILED."""
    for request in requests:
        if request.outcome is None:
            request.outcome, request.detail = FAILED, "no outcome: its worker never came back"
        elif request.outcome == LOST:
            assert request.ended_s is not None  # closed with its outcome
            inside = window[0] <= request.ended_s <= window[1]
            request.outcome = REFUSED if inside else FAILED
            request.detail = (
                request.detail if inside else f"outside the kill window: {request.detail}"
            )


def names_field(message: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", message) is not None


def grpc_outcome(error: InferenceServerException) -> tuple[str, str]:
    """A gRPC request's error as an outcome (see the module docstring). An error the server
    sent in the stream has no status; a status is the stream's own end (HAProxy's reset)."""
    message = error.message()
    if error.status() is None:
        return (REFUSED if any(o in message for o in OVERLOADED) else FAILED), message
    detail = f"{error.status()}: {message}"
    if error.status() == "StatusCode.UNAVAILABLE" or "RST_STREAM" in message:
        return LOST, detail
    return FAILED, detail


def openai_outcome(error: openai.APIError) -> tuple[str, str]:
    """An OpenAI request's error as an outcome: a status error (before the stream) or an
    error event (during it), whose body is OpenAI's error object."""
    body = error.body if isinstance(error.body, dict) else {}
    message = str(body.get("message") or error.message)
    status = getattr(error, "status_code", "event")
    detail = f"{status}: {message}"
    if body.get("code") == "overloaded":  # queue full, a replica stopping
        return REFUSED, detail
    if status == 503 or message.startswith("Triton unavailable"):
        return LOST, detail
    return FAILED, detail


# -- the load --------------------------------------------------------------------------------
class CancelledByClient(Exception):
    """Raised from a stream's chunk callback to leave it before its final response."""


@dataclass
class Load:
    """What the workers share."""

    url: str  # the gateway's gRPC
    openai_url: str
    openai_model: str
    config: ReplicasSoakConfig
    prompts: dict[str, list[str]]  # workload -> chat-templated prompts (gRPC)
    messages: dict[str, list[list[Message]]]  # workload -> chat messages (OpenAI)
    ledger: Ledger
    deadline: float  # monotonic
    # kind -> how many of that kind the run has sent: n picks a request's prompt, its inputs,
    # when to cancel it, ... (itertools.count's next() is atomic)
    sent: dict[str, itertools.count] = field(
        default_factory=lambda: {kind: itertools.count() for kind in MIX}
    )


def grpc_request(
    url: str,
    model: str,
    prompt: str,
    params: dict[str, Any],
    cancel_after: int | None = None,
    refusal_of: str | None = None,
) -> tuple[str, str]:
    """One request on a stream of its own; cancelled after `cancel_after` text chunks; a bad
    input that must be refused by naming `refusal_of`."""
    client = StreamingClient(url, model)
    chunks = 0

    def count(_chunk: str) -> None:
        nonlocal chunks
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            raise CancelledByClient

    try:
        result = client.generate(prompt, timeout=REQUEST_TIMEOUT_S, on_chunk=count, **params)
    except CancelledByClient:
        client.close()  # cancels it: the BLS frees its slot at its next iteration
        return CANCELLED, f"after {chunks} chunks"
    except queue.Empty:
        client.close()
        return FAILED, f"no final response within {REQUEST_TIMEOUT_S:.0f} s"
    except InferenceServerException as error:  # the stream failed as it opened
        client.close()
        return grpc_outcome(error)
    if result.error is not None:
        client.close()
        message = result.error.message()
        if refusal_of and result.error.status() is None and names_field(message, refusal_of):
            return REJECTED, message
        return grpc_outcome(result.error)
    return after_final(client, refusal_of)


def after_final(client: StreamingClient, refusal_of: str | None) -> tuple[str, str]:
    """Ends the stream without cancelling: stop_stream returns once the server has closed it,
    so whatever the server sent after the final response is in the queue by then."""
    client.client.stop_stream()
    extra = client.responses.qsize()
    client.close()
    if extra:
        return FAILED, f"{extra} responses after the final one"
    if refusal_of:
        return FAILED, f"{refusal_of}: a bad value served"
    return COMPLETED, ""


def openai_request(
    client: openai.OpenAI,
    load: Load,
    messages: list[Message],
    close_after: int | None = None,
    refusal_of: str | None = None,
    wrong: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """One streamed chat completion, closed after `close_after` chunks; `wrong`: arguments
    that must be refused by naming `refusal_of`."""
    arguments: dict[str, Any] = {"max_tokens": load.config.max_tokens, **(wrong or {})}
    chunks = finals = 0
    try:
        # cast: with **arguments the stubs cannot tell that stream=True returns a Stream
        stream = cast(
            "openai.Stream[Any]",
            client.chat.completions.create(
                model=load.openai_model, messages=cast(Any, messages), stream=True, **arguments
            ),
        )
        with stream:  # leaving it closes the connection: the API cancels the generation
            for chunk in stream:
                chunks += 1
                finals += sum(choice.finish_reason is not None for choice in chunk.choices)
                if close_after is not None and chunks >= close_after and not finals:
                    return CANCELLED, f"after {chunks} chunks"
    except openai.APIError as error:
        message = str(error.body.get("message")) if isinstance(error.body, dict) else ""
        if refusal_of and isinstance(error, openai.BadRequestError):
            return (REJECTED if names_field(message, refusal_of) else FAILED), message
        return openai_outcome(error)
    if refusal_of:
        return FAILED, f"{refusal_of}: a bad value served"
    return (COMPLETED, "") if finals == 1 else (FAILED, f"{finals} chunks with a finish_reason")


def send(kind: str, n: int, load: Load, client: openai.OpenAI) -> tuple[str, str]:
    """The run's n-th request of `kind` (MIX)."""
    workload = kind if kind in ("chat", "grounded") else ("chat", "grounded")[n % 2]
    prompts, messages = load.prompts[workload], load.messages[workload]
    prompt, chat = prompts[n % len(prompts)], messages[n % len(messages)]
    params: dict[str, Any] = {"max_tokens": load.config.max_tokens, "stream": True}
    if kind in ("chat", "grounded"):
        return grpc_request(
            load.url,
            "ensemble",
            prompt,
            {**params, **cast(dict, REQUEST_MIX[n % len(REQUEST_MIX)])},
        )
    if kind == "grpc-cancel":  # room to cancel in: four times the tokens, no end token
        params.update(max_tokens=4 * load.config.max_tokens, end_id=-1)
        return grpc_request(load.url, "speculative_decoding", prompt, params, 1 + n % 5)
    if kind == "bad-input-grpc":
        name, wrong = BAD_GRPC[n // 2 % len(BAD_GRPC)]  # each through both models in turn
        model = ("ensemble", "speculative_decoding")[n % 2]
        return grpc_request(load.url, model, prompt, {**params, **wrong}, refusal_of=name)
    if kind == "bad-input-openai":
        name, wrong = BAD_OPENAI[n % len(BAD_OPENAI)]
        return openai_request(client, load, chat, refusal_of=name, wrong=wrong)
    if kind == "openai-disconnect":
        return openai_request(client, load, chat, close_after=1 + n % 4)
    return openai_request(client, load, chat)  # openai-complete


def worker(index: int, load: Load) -> None:
    """Requests back to back until the deadline, each kind of MIX in turn."""
    client = openai.OpenAI(
        base_url=load.openai_url, api_key="soak", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    for step in itertools.count():
        if time.monotonic() >= load.deadline:
            break
        kind = MIX[(index + step) % len(MIX)]
        request = load.ledger.open(kind)
        try:
            outcome, detail = send(kind, next(load.sent[kind]), load, client)
        except Exception as error:  # unforeseen: a failure on the ledger; the load goes on
            outcome, detail = FAILED, repr(error)
        load.ledger.close(request, outcome, detail)


# -- the kill and the restart ----------------------------------------------------------------
@dataclass
class Restart:
    """The victim's kill and the launcher's restart of it, in seconds since the load began."""

    replica: str = ""
    killed_pid: int | None = None
    killed_s: float | None = None
    down_s: float | None = None  # out of both of the gateway's gRPC backends
    relaunched_s: float | None = None  # a new tritonserver on its ports
    back_s: float | None = None  # ready, calibrated and UP in both backends again
    error: str | None = None

    def window(self, end_s: float) -> tuple[float, float]:
        """When a request may lose its replica: from the kill until WINDOW_GRACE_S after the
        replica is back (the end of the run if it never came back); never without a kill."""
        if self.killed_s is None:
            return math.inf, math.inf
        back = end_s if self.back_s is None else self.back_s + WINDOW_GRACE_S
        return self.killed_s, back


def wait_until(condition: Callable[[], bool], deadline: float) -> bool:
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def kill_and_restart(
    launcher_pid: int, layout: Layout, config: ReplicasSoakConfig, clock: Clock, restart: Restart
) -> None:
    """At config.kill_s: SIGKILL to the victim's tritonserver; then when the gateway took it
    out, when the launcher started a new one, and when that one is back in the rotation."""
    victim = layout.replicas[VICTIM]
    restart.replica = victim.name
    time.sleep(max(0.0, config.kill_s - clock.now()))
    processes = replica_processes(launcher_pid, victim)
    if processes is None:
        restart.error = f"{victim.name} had no tritonserver at {clock.now():.0f} s"
        return
    killed = restart.killed_pid = processes[1]
    restart.killed_s = round(clock.now(), 2)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + config.restart_timeout_s
    steps: list[tuple[str, Callable[[], bool]]] = [
        ("down_s", lambda: not any(in_rotation(layout, victim, b) for b in GRPC_BACKENDS)),
        ("relaunched_s", lambda: relaunched(launcher_pid, victim, killed)),
        ("back_s", lambda: replica_serving(layout, victim)),
    ]
    for name, condition in steps:
        if not wait_until(condition, deadline):
            restart.error = f"{name}: not reached {config.restart_timeout_s:.0f} s after the kill"
            return
        setattr(restart, name, round(clock.now(), 2))


def in_rotation(layout: Layout, replica: Replica, backend: str) -> bool:
    try:
        return not server_states(layout.stats_port, backend)[replica.name].startswith("DOWN")
    except (OSError, KeyError):
        return True  # unknown yet: ask again


def relaunched(launcher_pid: int, replica: Replica, killed_pid: int) -> bool:
    processes = replica_processes(launcher_pid, replica)
    return processes is not None and processes[1] != killed_pid


# -- the run ---------------------------------------------------------------------------------
def replica_state(replica: Replica, num_slots: int) -> dict:
    """Its slots and gauges once idle, and the requests it counted by outcome (since its
    server started); live False when its metrics do not answer."""
    try:
        idle = True
        try:
            wait_until_idle(metrics_url(replica), IDLE_TIMEOUT_S)
        except TimeoutError:
            idle = False
        values = scrape_metrics(metrics_url(replica))
    except OSError:
        return {"live": False}
    return {
        "live": True,
        "idle": idle,
        "num_slots": num_slots,
        "free_kv_slots": values.get("specdec_free_kv_slots"),
        "running": values.get("specdec_running_batch_size"),
        "queued": values.get("specdec_queued_requests"),
        "requests": {k: v for k, v in values.items() if k.startswith(REQUESTS)},
    }


def slots_free(state: dict) -> bool:
    return (
        state.get("live", False)
        and state["free_kv_slots"] == state["num_slots"]
        and state["running"] == 0
        and state["queued"] == 0
    )


def start_load(
    config: ReplicasSoakConfig, layout: Layout, launcher: subprocess.Popen
) -> tuple[Load, list[threading.Thread], Restart]:
    """The workers and the kill, started (the prompts and the model's name read first, so that
    the load has all its time); what they record."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{layout.openai_port}/v1", api_key="soak")
    model = client.models.list().data[0].id
    prompts = {w: load_prompts(WORKLOADS[w]) for w in ("chat", "grounded")}
    messages = {w: prompt_messages(WORKLOADS[w]) for w in ("chat", "grounded")}
    clock = Clock()
    load = Load(
        url=f"127.0.0.1:{layout.grpc_port}",
        openai_url=str(client.base_url),
        openai_model=model,
        config=config,
        prompts=prompts,
        messages=messages,
        ledger=Ledger(clock),
        deadline=clock.start + config.duration_s,
    )
    restart = Restart()
    workers = [
        threading.Thread(target=worker, args=(i, load), daemon=True)
        for i in range(config.concurrency)
    ]
    killer = threading.Thread(
        target=kill_and_restart, args=(launcher.pid, layout, config, clock, restart), daemon=True
    )
    for thread in [*workers, killer]:
        thread.start()
    return load, [*workers, killer], restart


def soak(
    config: ReplicasSoakConfig, layout: Layout, launcher: subprocess.Popen, num_slots: int
) -> dict:
    """The load, the kill and the memory samples; then the ledger settled and the replicas
    scraped once idle."""
    tracked = lived_throughout(launcher.pid, layout)
    load, threads, restart = start_load(config, layout, launcher)
    clock = load.ledger.clock
    done = threading.Event()
    sampler = threading.Thread(
        target=sample_memory, args=(tracked, clock, config.sample_every_s, done), daemon=True
    )
    sampler.start()
    *workers, killer = threads
    for thread in workers:  # a worker still out after this has hung: its request failed
        thread.join(timeout=max(0.0, load.deadline - time.monotonic()) + REQUEST_TIMEOUT_S + 30)
    done.set()
    sampler.join()
    end_s = clock.now()
    killer.join(timeout=max(0.0, config.kill_s + config.restart_timeout_s - end_s) + 5)
    with load.ledger.lock:
        requests = list(load.ledger.requests)
    settle(requests, restart.window(end_s))
    return {
        "duration_s": round(end_s, 1),
        "requests": requests,
        "restart": restart,
        "replicas": {r.name: replica_state(r, num_slots) for r in layout.replicas},
        "memory": {p.name: memory_report(p, config) for p in tracked},
    }


def num_slots_of(env: dict[str, str]) -> int:
    """NUM_SLOTS as the replicas read it from their environment."""
    setting = settings.NUM_SLOTS
    return setting.parse(setting.variable, setting.from_env(env) or setting.default)


def judge(config: ReplicasSoakConfig, measured: dict, restarts: list[str], exit_code: int) -> dict:
    """The report: the figures, and each check by name (all must hold)."""
    requests: list[Request] = measured["requests"]
    restart: Restart = measured["restart"]
    counts = Counter(r.outcome for r in requests)
    states = list(measured["replicas"].values())
    survivor, victim = states[SURVIVOR], states[VICTIM]
    # Its counters began with the restarted server: whatever they count came after the kill.
    served_after_return = sum(victim.get("requests", {}).values())
    memory = measured["memory"]
    checks = {
        "no_failed_requests": counts[FAILED] == 0,
        "outcomes_sum_to_requests": sum(counts[o] for o in OUTCOMES) == len(requests) > 0,
        "every_kind_sent": set(MIX) <= {r.kind for r in requests},
        "completed_cancelled_and_rejected_seen": all(
            counts[o] > 0 for o in (COMPLETED, CANCELLED, REJECTED)
        ),
        "replica_killed": restart.killed_s is not None,
        "restarted_replica_back_and_took_requests": (
            restart.back_s is not None and served_after_return > 0
        ),
        "surviving_replica_slots_free": slots_free(survivor),
        "only_the_killed_replica_restarted": restarts == [restart.replica],
        "processes_lived_throughout": all(m["lived_throughout"] for m in memory.values()),
        "memory_growth_within_limit": all(
            m["growth"] is not None and m["growth"] <= config.max_growth for m in memory.values()
        ),
        "launcher_exited_0": exit_code == 0,
    }
    by_kind = {
        k: dict(Counter(r.outcome for r in requests if r.kind == k)) for k in sorted(set(MIX))
    }
    return {
        "config": {
            **asdict(config),
            "out_dir": str(config.out_dir),
            "warmup_s": config.warmup_s,
            "sample_every_s": config.sample_every_s,
            "kill_s": config.kill_s,
        },
        "duration_s": measured["duration_s"],
        "requests": len(requests),
        "outcomes": {o: counts[o] for o in OUTCOMES},
        "by_kind": by_kind,
        "kill_window_s": [
            w if math.isfinite(w) else None for w in restart.window(measured["duration_s"])
        ],
        "restart": asdict(restart),
        "restarts_in_launcher_log": restarts,
        "failures": [asdict(r) for r in requests if r.outcome == FAILED][:20],
        "retryable_refusals": [asdict(r) for r in requests if r.outcome == REFUSED][:20],
        "bad_input_messages": bad_input_messages(requests),
        "replicas": measured["replicas"],
        "memory": memory,
        "launcher_exit_code": exit_code,
        "checks": checks,
        "passed": all(checks.values()),
    }


def bad_input_messages(requests: list[Request]) -> dict[str, list[str]]:
    """What a client is told, by kind and field: each distinct refusal (gRPC: the ensemble's
    and the BLS's differ)."""
    messages: dict[str, list[str]] = {}
    for request in requests:
        if request.outcome == REJECTED:
            name = next(n for n, _ in (*BAD_GRPC, *BAD_OPENAI) if names_field(request.detail, n))
            seen = messages.setdefault(f"{request.kind}:{name}", [])
            if request.detail not in seen:
                seen.append(request.detail)
    return messages


def run(config: ReplicasSoakConfig) -> dict:
    layout = Layout.on_free_ports()
    run_dir = PROJECT_ROOT / ".run" / config.name
    log = run_dir / "launcher.log"
    env = {**os.environ, "DTYPE": os.environ.get("DTYPE", "auto"), **config.server_env}
    print(f"{config.name}: starting 2 replicas behind the gateway (log {log})", flush=True)
    launcher = start_launcher(layout, env, run_dir)
    try:
        wait_until_serving(launcher, layout, log)
        print(f"serving; {config.duration_s:.0f} s of load", flush=True)
        measured = soak(config, layout, launcher, num_slots_of(env))
    finally:
        exit_code = stop_launcher(launcher)
    report = judge(config, measured, launcher_restarts(log), exit_code)
    report["layout"] = asdict(layout)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / f"{config.name}.json").write_text(json.dumps(report, indent=1))
    return report


def summary(report: dict) -> list[str]:
    outcomes = ", ".join(f"{o} {n}" for o, n in report["outcomes"].items())
    restart = report["restart"]
    load_s = report["config"]["duration_s"]
    lines = [
        f"{report['requests']} requests in {report['duration_s']:.0f} s ({load_s:.0f} s of load, "
        f"then the requests in flight): {outcomes}",
        f"{restart['replica']} killed at {restart['killed_s']} s, out of the rotation at "
        f"{restart['down_s']} s, relaunched at {restart['relaunched_s']} s, back at "
        f"{restart['back_s']} s" + (f" ({restart['error']})" if restart["error"] else ""),
    ]
    for name, state in report["replicas"].items():
        slots = f"{state.get('free_kv_slots')}/{state.get('num_slots')}"
        lines.append(f"{name}: free KV slots {slots if state['live'] else '- (not live)'}")
    growth = ", ".join(f"{name} {percent(m['growth'])}" for name, m in report["memory"].items())
    lines.append(f"memory after {report['config']['warmup_s']:.0f} s: {growth}")
    lines.append(f"launcher exit status {report['launcher_exit_code']}")
    for failure in report["failures"][:5]:
        lines.append(f"  failed {failure['kind']} at {failure['ended_s']} s: {failure['detail']}")
    failed = [name for name, ok in report["checks"].items() if not ok]
    lines.append("passed" if not failed else f"FAILED: {', '.join(failed)}")
    return lines


def percent(growth: float | None) -> str:
    return "not measured" if growth is None else f"{100 * growth:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8, help="workers")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--kill-at", type=float, default=None, help="seconds into the load (default: half)"
    )
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--server-env", default="", help="NAME=VALUE,... for the replicas")
    parser.add_argument("--name", default="soak-replicas", help="<out-dir>/<name>.json")
    parser.add_argument("--out-dir", type=Path, default=PROJECT_ROOT / "results")
    args = parser.parse_args()
    if args.kill_at is not None and not 0 <= args.kill_at < args.duration:
        parser.error("--kill-at: must be within the load, 0 <= seconds < --duration")
    config = ReplicasSoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        kill_at_s=args.kill_at,
        max_growth=args.max_growth,
        server_env=parse_env(args.server_env),
        name=args.name,
        out_dir=args.out_dir,
    )
    report = run(config)
    print("\n".join(summary(report)))
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
