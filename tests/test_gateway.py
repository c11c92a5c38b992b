"""Two real Triton replicas behind the real gateway (HAProxy, specdec/gateway/).

Streams through the gateway are exact and spread over both replicas (their own metrics say
how many each finished); a replica that stops being ready leaves the rotation and comes
back; a replica killed under load ends its streams with an error while the other serves
every new request, and is used again once restarted. Small replicas (8 slots, short
outputs) keep the module within a few minutes on 2 cores.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tritonclient.utils import InferenceServerException

from live import is_final, scrape, start_victim, wait_for
from specdec.client import GenerationResult, StreamingClient, generate
from specdec.gateway.config import GatewayConfig, Replica, haproxy_binary
from specdec.gateway.serve import Gateway
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.processes import descendant_pids, free_port

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        haproxy_binary() is None,
        reason="haproxy not installed: apt-get install haproxy (.ci/run installs it)",
    ),
]

# DTYPE: float32 as the committed configs (make exports DTYPE=auto into the environment).
SMALL = {"NUM_SLOTS": "8", "MAX_CONTEXT": "512", "DTYPE": "float32"}
NAMES = ("test-gateway-a", "test-gateway-b")
THINGS = "copper salt glass rope wool clay sand ice oak silk iron wax tea corn soap milk".split()
PROMPTS = [  # ChatML: SmolLM2-Instruct answers (a bare instruction may get an end token first)
    f"<|im_start|>user\nName one use of {thing}.<|im_end|>\n<|im_start|>assistant\n"
    for thing in THINGS
]


def replica(name: str, server: ManagedServer) -> Replica:
    c = server.config
    return Replica(name, "127.0.0.1", c.grpc_port, c.http_port, c.metrics_port)


@pytest.fixture(scope="module")
def servers(target_dir):
    # Started from threads kept alive until the end: a server started with
    # PR_SET_PDEATHSIG gets SIGTERM when the *thread* that started it exits.
    pool = ThreadPoolExecutor(2)
    futures = [pool.submit(ManagedServer, name, SMALL) for name in NAMES]
    try:
        running = [f.result() for f in futures]
    except Exception:
        for future in futures:
            if future.exception() is None:
                future.result().stop()
        pool.shutdown()
        raise
    yield running  # the kill test replaces the second with its restarted server
    for server in running:
        server.stop()
    pool.shutdown()


def new_gateway(servers: list[ManagedServer], name: str, replicas=None) -> Gateway:
    config = GatewayConfig(
        replicas or [replica(f"replica{i}", s) for i, s in enumerate(servers)],
        grpc_port=free_port(),
        http_port=free_port(),
        stats_port=free_port(),
        run_dir=PROJECT_ROOT / ".run" / name,
    )
    gateway = Gateway(config)
    for r in config.replicas:
        gateway.wait_for_state(r.name, "UP")
    return gateway


@pytest.fixture(scope="module")
def gateway(servers):
    running = new_gateway(servers, "test-gateway")
    yield running
    running.stop()


def finished(server: ManagedServer) -> float:
    """Requests the replica has finished, every outcome."""
    values = scrape(server.metrics_url)
    return sum(v for k, v in values.items() if k.startswith("specdec_requests_total"))


def stream(url: str, prompt: str, max_tokens: int = 8) -> GenerationResult:
    """Greedy (the default temperature), streamed, through the ensemble."""
    return generate(
        prompt,
        url=url,
        model="ensemble",
        max_tokens=max_tokens,
        stream=True,
        exclude_input_in_output=True,
    )


def stream_all(url: str, prompts: list[str], max_tokens: int = 8) -> list[GenerationResult]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream(url, p, max_tokens), prompts))
    assert [r.error for r in results if r.error] == []
    return results


def test_concurrent_streams_are_exact_and_both_replicas_serve_some(servers, gateway):
    before = [finished(s) for s in servers]
    through_gateway = stream_all(gateway.url, PROMPTS)
    served = [finished(s) - b for s, b in zip(servers, before, strict=True)]
    assert sum(served) == len(PROMPTS)
    assert min(served) >= 4, served  # least connections: close to half each
    single = stream_all(servers[0].url, PROMPTS)  # the reference: one server, no gateway
    assert [r.text for r in through_gateway] == [r.text for r in single]
    assert all(r.text for r in single) and any(len(r.chunks) > 1 for r in through_gateway)


def test_the_autoscaler_gauges_are_published(servers):
    # deploy/kubernetes/base/monitoring.yaml's recording rule reads these three.
    values = scrape(servers[0].metrics_url)
    for name in ("specdec_queued_requests", "specdec_running_batch_size", "specdec_free_kv_slots"):
        assert name in values
    assert values["specdec_free_kv_slots"] == float(SMALL["NUM_SLOTS"])


class Health(BaseHTTPRequestHandler):
    """/v2/health/ready answering whatever `status` says (a replica's HTTP side)."""

    status = 200

    def do_GET(self) -> None:
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def gateway_with_toggled_b(
    servers: list[ManagedServer], name: str
) -> Iterator[tuple[Gateway, type]]:
    """A gateway over replicas a and b, b's readiness answered by a `Health` of its own (b's
    gRPC port is the real one); yields the gateway and that handler class, whose `status`
    takes b out of the rotation (503) and back (200)."""
    health = ThreadingHTTPServer(("127.0.0.1", 0), type("Toggle", (Health,), {}))
    threading.Thread(target=health.serve_forever, daemon=True).start()
    b = replica("b", servers[1])
    b.http_port = health.server_address[1]
    gateway = new_gateway(servers, name, [replica("a", servers[0]), b])
    try:
        yield gateway, health.RequestHandlerClass
    finally:
        gateway.stop()
        health.shutdown()


def test_a_replica_that_is_not_ready_leaves_the_rotation_and_comes_back(servers):
    with gateway_with_toggled_b(servers, "test-gateway-health") as (gateway, b_health):
        b_health.status = 503
        gateway.wait_for_state("b", "DOWN", timeout=10)
        before = [finished(s) for s in servers]
        stream_all(gateway.url, PROMPTS[:4], max_tokens=2)
        assert [finished(s) - n for s, n in zip(servers, before, strict=True)] == [4, 0]
        b_health.status = 200
        gateway.wait_for_state("b", "UP", timeout=10)
        before = finished(servers[1])
        stream_all(gateway.url, PROMPTS[4:8], max_tokens=2)
        assert finished(servers[1]) > before


def attempt(url: str, prompt: str) -> GenerationResult:
    """A request whose failure is a result. When the stream broke before the request went
    out, tritonclient raises a generic error and the stream's own lands in the callback."""
    with StreamingClient(url, "ensemble") as client:
        try:
            return client.generate(prompt, max_tokens=8, stream=True, exclude_input_in_output=True)
        except InferenceServerException:
            _, error = client.responses.get(timeout=10)
            return GenerationResult(error=error)


def reset_by_the_gateway(error: InferenceServerException) -> bool:
    """HAProxy reset the stream when the replica's connection died: REFUSED_STREAM (HTTP/2
    code 7, gRPC UNAVAILABLE) for a stream it had just put on that connection, an error code
    (gRPC INTERNAL) for one the replica was answering."""
    statuses = ("StatusCode.UNAVAILABLE", "StatusCode.INTERNAL")
    return error.status() in statuses and "RST_STREAM" in error.message()


def kill_tree(server: ManagedServer) -> None:
    for pid in [server.process.pid, *descendant_pids(server.process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_replica_ends_its_streams_the_other_serves_and_a_restart_rejoins(servers, gateway):
    survivor, victim = servers
    streams = [
        start_victim(gateway.url, f"Write a long story about ship number {i}.", 32, "ensemble")
        for i in range(4)
    ]
    for _, responses in streams:
        wait_for(lambda responses=responses: len(responses) >= 2, 120)
    on_victim = scrape(victim.metrics_url)["specdec_running_batch_size"]
    assert 1 <= on_victim <= 3  # least connections put streams on both

    before = finished(survivor)
    kill_tree(victim)
    # Sent while the replica dies: one the gateway put on its connection before the kernel
    # closed it is reset (a stream cannot be resent), the others go to the survivor; none
    # hangs, and none ends early without an error.
    with ThreadPoolExecutor(4) as pool:
        racing = list(pool.map(lambda p: attempt(gateway.url, p), PROMPTS[:4]))
    expected = stream_all(survivor.url, PROMPTS[:4])  # the reference: no gateway
    for result, reference in zip(racing, expected, strict=True):
        if result.error is None:
            assert result.text == reference.text
        else:
            assert reset_by_the_gateway(result.error), (
                result.error.status(),
                result.error.message(),
            )
    served = [r for r in racing if r.error is None]
    assert served and finished(survivor) >= before + len(served) + len(expected)
    gateway.wait_for_state("replica1", "DOWN", timeout=10)
    before = finished(survivor)
    later = stream_all(gateway.url, PROMPTS[4:8], 4)  # once the gateway saw it die: all
    assert all(r.text for r in later) and finished(survivor) >= before + len(later)
    for _, responses in streams:  # none hangs
        wait_for(lambda responses=responses: any(is_final(r, e) for r, e in responses), 180)
    errors = [e for _, responses in streams for _, e in responses if e is not None]
    assert len(errors) == on_victim, [e.message() for e in errors]
    assert all("RST_STREAM" in e.message() for e in errors), [e.message() for e in errors]
    for client, _ in streams:
        client.close()
    victim.stop()

    ports = {"HTTP_PORT": victim.config.http_port, "GRPC_PORT": victim.config.grpc_port}
    ports["METRICS_PORT"] = victim.config.metrics_port
    restarted = ManagedServer(NAMES[1], {**SMALL, **{k: str(v) for k, v in ports.items()}})
    servers[1] = restarted  # the fixture stops it
    gateway.wait_for_state("replica1", "UP", timeout=30)
    stream_all(gateway.url, PROMPTS[8:12], max_tokens=2)
    assert finished(restarted) >= 1


def served_by(servers: list[ManagedServer], url: str, session_id: str) -> int:
    """Which replica served one stream of the session (2 tokens)."""
    before = [finished(s) for s in servers]
    result = generate(
        PROMPTS[0], url=url, model="ensemble", session_id=session_id, max_tokens=2, stream=True
    )
    assert result.error is None, result.error
    served = [finished(s) - b for s, b in zip(servers, before, strict=True)]
    assert sorted(served) == [0, 1], served
    return served.index(1)


def test_a_sessions_streams_stay_on_one_replica_and_move_only_while_it_is_gone(servers):
    """The session-id header pins a conversation's streams (each a stream of its own, as the
    OpenAI API sends them) to one replica, where its prefix is cached; when that replica
    leaves the rotation they go to the other, and come back with it."""
    with gateway_with_toggled_b(servers, "test-gateway-sessions") as (gateway, b_health):
        homes = {}
        for session in (f"conversation-{i}" for i in range(10)):
            first = served_by(servers, gateway.url, session)
            assert [served_by(servers, gateway.url, session) for _ in range(2)] == [first] * 2
            homes[session] = first
        assert set(homes.values()) == {0, 1}, homes  # the keys spread over both
        on_b = next(s for s, home in homes.items() if home == 1)
        b_health.status = 503
        gateway.wait_for_state("b", "DOWN", timeout=10)
        assert served_by(servers, gateway.url, on_b) == 0
        b_health.status = 200
        gateway.wait_for_state("b", "UP", timeout=10)
        assert served_by(servers, gateway.url, on_b) == 1
