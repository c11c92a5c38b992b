"""The gateway's configuration: haproxy.cfg for fixed replicas, for Kubernetes pods and for
compose services, and HAProxy's own check of a file.

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
- A gRPC stream with a `session-id` header (a conversation's key) goes to the replica that
  key hashes to (`balance hdr`, consistent hashing), so a conversation's turns find their
  prefix in that replica's KV cache (docs/scaling.md, Sessions). If that replica is out of
  the rotation, its keys hash to the others (only its keys move) and their next turn
  prefills whole there; when it comes back, they move back. Streams without one are
  balanced by least connections.
- With security settings (security.py: client keys, a bound per key, TLS) the frontends
  check each request's key before it is balanced (`serve` and compose's gateway; the
  Kubernetes rendering has none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from specdec.gateway.security import KEY_TABLE, GatewaySecurity, key_rules
from specdec.paths import PROJECT_ROOT
from specdec.triton_access import SESSION_HEADER

STREAM_TIMEOUT = "1h"  # a queued stream may wait minutes for its first byte
HEALTH_PATH = "/v2/health/ready"
GRPC_BACKENDS = ("triton_grpc", "triton_grpc_session")  # least connections; by session key


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
    security: GatewaySecurity = field(default_factory=GatewaySecurity)  # default: none

    @property
    def keys_path(self) -> Path:
        """Where the gateway writes the client keys for HAProxy (owner-only)."""
        return self.run_dir / "keys.lst"

    @property
    def config_path(self) -> Path:
        """Where the gateway writes its haproxy.cfg."""
        return self.run_dir / "haproxy.cfg"


def haproxy_binary() -> str | None:
    """The haproxy executable (Debian puts it in /usr/sbin, not always on PATH)."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )


def require_haproxy() -> str:
    """haproxy_binary(), or a FileNotFoundError that says how to install it."""
    binary = haproxy_binary()
    if binary is None:
        raise FileNotFoundError("haproxy not found: apt-get install haproxy")
    return binary


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
        "frontend grpc",  # gRPC = HTTP/2 (h2c, or TLS); each stream balanced on its own
        f"    bind {bind}:{config.grpc_port} proto h2{_tls(config, 'h2')}",
        *_indent(key_rules(config.security, config.keys_path, grpc=True)),
        *_indent(_grpc_refusals_content_type(config.security)),
        f"    use_backend triton_grpc_session if {{ req.hdr({SESSION_HEADER}) -m found }}",
        "    default_backend triton_grpc",
        "",
        "frontend http",  # KServe v2 HTTP/REST (health, metadata, non-streamed infer)
        f"    bind {bind}:{config.http_port}{_tls(config, 'h2,http/1.1')}",
        *_indent(key_rules(config.security, config.keys_path, grpc=False)),
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


def _tls(config: GatewayConfig, alpn: str) -> str:
    """A bind's TLS options: GATEWAY_SSL_CERT terminates TLS here (the checks need headers)."""
    cert = config.security.ssl_cert
    return f" ssl crt {cert} alpn {alpn}" if cert else ""


def _indent(lines: list[str]) -> list[str]:
    return [f"    {line}" for line in lines]


def _grpc_refusals_content_type(security: GatewaySecurity) -> list[str]:
    """HAProxy drops a content type from a reply without a body; gRPC clients want one. Only
    a trailers-only reply has grpc-status among its headers (the replicas' are alike)."""
    if not security.keys:
        return []
    return [
        "http-after-response set-header content-type application/grpc"
        " if { res.fhdr_cnt(grpc-status) gt 0 }"
    ]


def _key_table(security: GatewaySecurity) -> list[str]:
    """The stick table of keys in flight: SHA-256 of each key (no key in HAProxy's memory
    dumps); its entries' reference counts are the requests tracking each key now. Only
    listed keys are tracked, so it holds at most one entry per line of the keys file."""
    if not security.max_concurrent_per_key:
        return []
    return [f"backend {KEY_TABLE}", "    stick-table type binary len 32 size 100k", ""]


def _backend(
    name: str,
    servers: list[str],
    check: GatewayConfig,
    balance: str = "leastconn",
    options: tuple[str, ...] = (),
) -> list[str]:
    return [
        f"backend {name}",
        f"    balance {balance}",
        *[f"    option {option}" for option in options],
        "    option httpchk",
        f"    http-check send meth GET uri {HEALTH_PATH}",
        "    http-check expect status 200",
        f"    default-server inter {check.check_interval_ms} fall {check.fall} rise {check.rise}"
        " observe layer4 error-limit 1 on-error mark-down",
        *[f"    {line}" for line in servers],
        "",
    ]


def _http_backend(servers: list[str], check: GatewayConfig) -> list[str]:
    """Each HTTP request on a connection of its own to the replica: a stopping Triton waits
    for every open HTTP connection, and idle ones kept for reuse held it to its exit
    timeout."""
    return _backend("triton_http", servers, check, options=("http-server-close",))


def _grpc_backends(servers: list[str], check: GatewayConfig) -> list[str]:
    """Least connections, and the same replicas by session key (consistent hashing)."""
    by_session = f"hdr({SESSION_HEADER})\n    hash-type consistent"
    by_connections, by_key = GRPC_BACKENDS
    return _backend(by_connections, servers, check) + _backend(
        by_key, servers, check, balance=by_session
    )


def render_config(config: GatewayConfig) -> str:
    """haproxy.cfg for fixed replicas (each checked on its own HTTP port)."""
    lines = _common(config.address, config) + _replica_backends(config)
    return "\n".join(lines)


def _replica_backends(config: GatewayConfig, server_options: str = "") -> list[str]:
    """The gRPC and HTTP backends of config.replicas, and the key table if one is needed;
    server_options: what each server line has after its address (compose: resolvers)."""
    grpc = [
        f"server {r.name} {r.host}:{r.grpc_port}{server_options} proto h2{_replica_tls(config)}"
        f" check port {r.http_port} check-proto h1"
        for r in config.replicas
    ]
    http = [
        f"server {r.name} {r.host}:{r.http_port}{server_options} check" for r in config.replicas
    ]
    lines = _grpc_backends(grpc, config) + _http_backend(http, config)
    return lines + _key_table(config.security)


def _replica_tls(config: GatewayConfig) -> str:
    """Replicas that serve gRPC over TLS (GRPC_SSL_CERT): re-encrypted, their certificate
    checked against the CA; their HTTP port (the check's) stays plain."""
    ca = config.security.replica_ca
    return f" ssl verify required ca-file {ca} alpn h2 no-check-ssl" if ca else ""


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
    lines += _grpc_backends(grpc, config) + _http_backend(http, config)
    return "\n".join(lines)


# docker compose on a host with several GPUs: one Triton service per GPU, found by service
# name through Docker's DNS (a service outside the active profiles stays out of rotation).
# The gateway's container renders this (`python -m specdec.gateway compose`, serve.py) with
# the security settings of its environment; `compose-config` prints it without them.
COMPOSE_SERVICES = ("triton", "triton-gpu1", "triton-gpu2", "triton-gpu3")


def compose_config(
    security: GatewaySecurity | None = None, run_dir: Path | None = None
) -> GatewayConfig:
    """The compose gateway: every Triton service by name, on the container's own ports."""
    replicas = [Replica(s, s, grpc_port=8001, http_port=8000) for s in COMPOSE_SERVICES]
    config = GatewayConfig(replicas, address="*", security=security or GatewaySecurity())
    if run_dir is not None:
        config.run_dir = run_dir
    return config


def render_compose_config(config: GatewayConfig | None = None) -> str:
    """haproxy.cfg for replicas found through Docker's DNS (default: compose_config())."""
    config = config or compose_config()
    lines = _common(config.address, config)
    lines += ["resolvers docker", "    nameserver dns 127.0.0.11:53", ""]
    lines += _replica_backends(config, " resolvers docker init-addr last,libc,none")
    return "\n".join(lines)


def check_config(path: Path, env: dict[str, str] | None = None) -> None:
    """haproxy -c: raises with HAProxy's own message when the file is not valid."""
    result = subprocess.run(
        [require_haproxy(), "-c", "-q", "-f", str(path)], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise ValueError(f"{path}: {result.stdout}{result.stderr}")
