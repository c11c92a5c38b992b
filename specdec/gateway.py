"""Several Triton replicas behind one L7 gRPC gateway: HAProxy, configured and run by us.

    python -m specdec.gateway serve --replicas 2 --openai  # `make serve REPLICAS=2`
    python -m specdec.gateway drain              # a Kubernetes preStop: settle, then idle
    python -m specdec.gateway kubernetes-config  # deploy/kubernetes/base/gateway.yaml's
    python -m specdec.gateway compose-config     # deploy/compose/haproxy.cfg

A gRPC stream is one HTTP/2 stream, and one client connection carries many: a layer-4
balancer (a Kubernetes Service) pins them all to one replica. HAProxy terminates HTTP/2 and
picks a replica per stream. We use HAProxy, not nginx, because open-source nginx has no
active health checks, and a replica must leave the rotation when its /v2/health/ready
fails (a server loading its models or shutting down; Triton 2.51 stays ready with a dead
stub, so the supervisor stops such a server) and come back when it passes again; HAProxy
checks that endpoint itself (Debian packages it: `apt-get install haproxy`).
- `balance leastconn` counts the streams each replica serves: a new stream goes to the
  replica with the fewest in flight, so a replica whose KV slots are all taken (and whose
  streams therefore last) gets fewer new ones.
- Active check: GET /v2/health/ready on each replica's HTTP port every second; 2 failures
  take it out, 2 passes put it back. Passive: a refused connection takes it out at once,
  and the request is sent to another replica (`retries`, `option redispatch`).
- Streams already on a replica that is taken out run on to their end; the streams of a
  replica that dies end with an error at the client (HAProxy resets them), and so may a
  request sent in the moment it dies (a stream cannot be sent twice).
Replicas' own ports: REPLICA_BASE_PORT (8100) + 10 i: HTTP, + 1 gRPC, + 2 metrics. With
--openai the OpenAI-compatible API (specdec.openai_api) runs in front of the gateway.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.paths import PROJECT_ROOT
from specdec.processes import end_with_parent, is_ready

STREAM_TIMEOUT = "1h"  # a queued stream may wait minutes for its first byte
HEALTH_PATH = "/v2/health/ready"


@dataclass
class Replica:
    name: str
    host: str
    grpc_port: int
    http_port: int
    metrics_port: int | None = None


@dataclass
class GatewayConfig:
    replicas: list[Replica]
    grpc_port: int = 8001
    http_port: int = 8000
    stats_port: int = 8404  # HAProxy's Prometheus exporter (/metrics), /stats, /healthz
    address: str = "127.0.0.1"
    check_interval_ms: int = 1000
    fall: int = 2  # failed checks that take a replica out
    rise: int = 2  # passed checks that put it back
    run_dir: Path = field(default_factory=lambda: PROJECT_ROOT / ".run" / "gateway")


def haproxy_binary() -> str | None:
    """The haproxy executable (Debian puts it in /usr/sbin, not always on PATH)."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )


def _common(bind: str, config: GatewayConfig) -> list[str]:
    """global, defaults, the two frontends and the stats listener."""
    return [
        "global",
        "    maxconn 4096",  # connections; each carries many streams
        "",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        f"    timeout client {STREAM_TIMEOUT}",
        f"    timeout server {STREAM_TIMEOUT}",
        "    timeout check 2s",
        "    retries 2",  # connection failures only: a request a replica got is never resent
        "    option redispatch 1",  # every retry goes to another replica
        "",
        "frontend grpc",  # gRPC = HTTP/2 without TLS (h2c); each stream balanced on its own
        f"    bind {bind}:{config.grpc_port} proto h2",
        "    default_backend triton_grpc",
        "",
        "frontend http",  # KServe v2 HTTP/REST (health, metadata, non-streamed infer)
        f"    bind {bind}:{config.http_port}",
        "    default_backend triton_http",
        "",
        "frontend stats",
        f"    bind {bind}:{config.stats_port}",
        "    monitor-uri /healthz",  # 200 while at least one replica is in the rotation
        "    monitor fail if { nbsrv(triton_grpc) lt 1 }",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "    stats enable",
        "    stats uri /stats",
        "    stats refresh 5s",
        "",
    ]


def _backend(name: str, servers: list[str], check: GatewayConfig) -> list[str]:
    return [
        f"backend {name}",
        "    balance leastconn",
        "    option httpchk",
        f"    http-check send meth GET uri {HEALTH_PATH}",
        "    http-check expect status 200",
        f"    default-server inter {check.check_interval_ms} fall {check.fall} rise {check.rise}"
        " observe layer4 error-limit 1 on-error mark-down",
        *[f"    {line}" for line in servers],
        "",
    ]


def render_config(config: GatewayConfig) -> str:
    """haproxy.cfg for fixed replicas (each checked on its own HTTP port)."""
    grpc = [
        f"server {r.name} {r.host}:{r.grpc_port} proto h2 check port {r.http_port} check-proto h1"
        for r in config.replicas
    ]
    http = [f"server {r.name} {r.host}:{r.http_port} check" for r in config.replicas]
    lines = _common(config.address, config)
    lines += _backend("triton_grpc", grpc, config) + _backend("triton_http", http, config)
    return "\n".join(lines)


# Kubernetes: the replicas are the pods behind a headless Service; HAProxy resolves its name
# and fills up to MAX_PODS server slots with the addresses it returns (a pod that is not
# ready is not in the answer). deploy/kubernetes/base/gateway.yaml carries this text.
MAX_PODS = 32
HEADLESS_NAME = "specdec-triton.${POD_NAMESPACE}.svc.${CLUSTER_DOMAIN-cluster.local}"


def render_kubernetes_config() -> str:
    config = GatewayConfig(replicas=[])
    lines = _common("*", config)
    lines += [
        "resolvers cluster",
        "    parse-resolv-conf",
        "    timeout resolve 1s",
        "",
    ]
    dns = "resolvers cluster init-addr none"
    grpc = [
        f'server-template triton 1-{MAX_PODS} "{HEADLESS_NAME}:8001" {dns}'
        " proto h2 check port 8000 check-proto h1"
    ]
    http = [f'server-template triton 1-{MAX_PODS} "{HEADLESS_NAME}:8000" {dns} check']
    lines += _backend("triton_grpc", grpc, config) + _backend("triton_http", http, config)
    return "\n".join(lines)


# docker compose on a host with several GPUs: one Triton service per GPU, found by service
# name through Docker's DNS (a service outside the active profiles stays out of rotation).
# deploy/compose/haproxy.cfg is this text for COMPOSE_SERVICES.
COMPOSE_SERVICES = ("triton", "triton-gpu1", "triton-gpu2", "triton-gpu3")


def render_compose_config(services: tuple[str, ...] = COMPOSE_SERVICES) -> str:
    config = GatewayConfig(replicas=[])
    lines = _common("*", config)
    lines += ["resolvers docker", "    nameserver dns 127.0.0.11:53", ""]
    dns = "resolvers docker init-addr last,libc,none"
    grpc = [f"server {s} {s}:8001 {dns} proto h2 check port 8000 check-proto h1" for s in services]
    http = [f"server {s} {s}:8000 {dns} check" for s in services]
    lines += _backend("triton_grpc", grpc, config) + _backend("triton_http", http, config)
    return "\n".join(lines)


def check_config(path: Path, env: dict[str, str] | None = None) -> None:
    """haproxy -c: raises with HAProxy's own message when the file is not valid."""
    binary = haproxy_binary()
    if binary is None:
        raise FileNotFoundError("haproxy not found: apt-get install haproxy")
    result = subprocess.run(
        [binary, "-c", "-q", "-f", str(path)], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ValueError(f"{path}: {result.stdout}{result.stderr}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class Gateway:
    """HAProxy in front of fixed replicas (tests, `make serve REPLICAS=N`); stop() ends it."""

    def __init__(self, config: GatewayConfig, timeout: float = 30.0):
        self.config = config
        config.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = config.run_dir / "haproxy.cfg"
        self.config_path.write_text(render_config(config))
        check_config(self.config_path)
        self.log_path = config.run_dir / "haproxy.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(self.config_path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=end_with_parent,
        )
        deadline = time.time() + timeout
        while not all(port_open(p) for p in (config.grpc_port, config.stats_port)):
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"haproxy did not start; see {self.log_path}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    def server_states(self, backend: str = "triton_grpc") -> dict[str, str]:
        """Replica name -> HAProxy's status of it: UP, DOWN, 'UP 1/2' (rising), ..."""
        url = f"http://127.0.0.1:{self.config.stats_port}/stats;csv"
        text = urllib.request.urlopen(url, timeout=5).read().decode().lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_for_state(self, replica: str, state: str, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while (current := self.server_states().get(replica)) != state:
            if time.time() > deadline:
                raise TimeoutError(f"{replica} is {current}, not {state}, after {timeout} s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def replica_ports(index: int, base: int) -> Replica:
    """Replica i of `make serve REPLICAS=N`: HTTP base + 10 i, gRPC + 1, metrics + 2."""
    port = base + 10 * index
    return Replica(f"replica{index}", "127.0.0.1", port + 1, port, port + 2)


def start_replica(replica: Replica, env: dict[str, str], run_dir: Path) -> subprocess.Popen:
    """A supervised server (as the container runs it): it exits 1 once it stops being ready,
    and `serve` starts it again."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = {
        "HTTP_PORT": str(replica.http_port),
        "GRPC_PORT": str(replica.grpc_port),
        "METRICS_PORT": str(replica.metrics_port),
        "RUN_DIR": str(run_dir),
    }
    with open(run_dir / "server.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "specdec.launch", "--exit-when-unready"],
            env={**env, **ports},
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=end_with_parent,
        )


def serve(num_replicas: int, env: dict[str, str], openai: bool = False) -> int:
    """N replicas and the gateway on GRPC_PORT / HTTP_PORT until SIGINT or SIGTERM; a replica
    that exits is started again (its streams ended with an error; the gateway skips it
    meanwhile). openai: the OpenAI-compatible API too, calling the gateway."""
    if haproxy_binary() is None:
        print("haproxy not found: apt-get install haproxy", file=sys.stderr)
        return 2
    run_dir = Path(env.get("RUN_DIR", PROJECT_ROOT / ".run"))
    base = int(env.get("REPLICA_BASE_PORT", 8100))
    replicas = [replica_ports(i, base) for i in range(num_replicas)]
    config = GatewayConfig(
        replicas,
        grpc_port=int(env.get("GRPC_PORT", 8001)),
        http_port=int(env.get("HTTP_PORT", 8000)),
        stats_port=int(env.get("GATEWAY_STATS_PORT", 8404)),
        run_dir=run_dir / "gateway",
    )
    processes = {r.name: start_replica(r, env, run_dir / r.name) for r in replicas}
    if openai:  # it reads GRPC_PORT and HTTP_PORT: the gateway's
        command = [sys.executable, "-m", "specdec.openai_api"]
        subprocess.Popen(command, env=env, preexec_fn=end_with_parent)
    stopping: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: stopping.append(signum))
    with Gateway(config) as gateway:
        _print_layout(config, run_dir)
        while not stopping:
            time.sleep(1.0)
            for replica in replicas:
                code = processes[replica.name].poll()
                if code is not None and not stopping:
                    print(f"{replica.name} exited ({code}); starting it again", flush=True)
                    processes[replica.name] = start_replica(replica, env, run_dir / replica.name)
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            process.wait()
        gateway.stop()
    return 0


def _print_layout(config: GatewayConfig, run_dir: Path) -> None:
    print(
        f"gateway (HAProxy) on {config.address}: gRPC {config.grpc_port}, HTTP "
        f"{config.http_port}, stats http://{config.address}:{config.stats_port}/stats",
        flush=True,
    )
    for r in config.replicas:
        ready = "ready" if is_ready(r.http_port) else "starting"
        print(
            f"  {r.name}: HTTP {r.http_port}, gRPC {r.grpc_port}, metrics {r.metrics_port} "
            f"({ready}; log {run_dir / r.name / 'server.log'})",
            flush=True,
        )


def drain(metrics_url: str, settle_s: float, timeout_s: float, poll_s: float = 1.0) -> bool:
    """A replica's preStop. Stopping the server ends its running streams with an error
    (outcome `shutdown`), so wait first: `settle_s` for the gateway to stop sending new
    requests here (the pod has left the headless Service's DNS answer), then until nothing
    runs or waits in the queue. False when `timeout_s` passed first."""
    from specdec.client import scrape_metrics

    time.sleep(settle_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            values = scrape_metrics(metrics_url)
        except OSError:
            return True  # the server is gone: nothing left to wait for
        gauges = ("specdec_running_batch_size", "specdec_queued_requests")
        busy = sum(v for k, v in values.items() if k.split("{")[0] in gauges)
        if not busy:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("serve", help="N replicas behind the gateway (default)")
    run.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", 2)))
    run.add_argument("--openai", action="store_true", help="and the OpenAI-compatible API")
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
    elif args.command == "kubernetes-config":
        print(render_kubernetes_config(), end="")
    elif args.command == "compose-config":
        print(render_compose_config(), end="")
    else:
        replicas = getattr(args, "replicas", int(os.environ.get("REPLICAS", 2)))
        sys.exit(serve(replicas, dict(os.environ), openai=getattr(args, "openai", False)))


if __name__ == "__main__":
    main()
