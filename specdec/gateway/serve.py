"""Running the gateway: HAProxy as a child process in front of fixed replicas (tests,
`make serve REPLICAS=N`), `serve`, which starts N supervised replicas behind it, and
`compose`, which runs HAProxy in docker-compose.yml's gateway container.

Replicas' own ports: REPLICA_BASE_PORT (8100) + 10 i: HTTP, + 1 gRPC, + 2 metrics. With
--openai the OpenAI-compatible API (specdec.openai_api) runs in front of the gateway.
"""

from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from specdec.gateway.config import (
    GRPC_BACKENDS,
    GatewayConfig,
    Replica,
    check_config,
    compose_config,
    haproxy_binary,
    render_compose_config,
    render_config,
    require_haproxy,
)
from specdec.gateway.security import GatewaySecurity, describe
from specdec.paths import PROJECT_ROOT
from specdec.processes import end_with_parent, is_ready, port_open, terminate
from specdec.server_config import memory_fits


class Gateway:
    """HAProxy in front of fixed replicas (tests, `make serve REPLICAS=N`); stop() ends it."""

    def __init__(
        self,
        config: GatewayConfig,
        timeout: float = 30.0,
        render: Callable[[GatewayConfig], str] = render_config,
    ):
        self.config = config
        self.config_path = config.config_path
        env = write_config(config, dict(os.environ), render)
        self.log_path = config.run_dir / "haproxy.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [require_haproxy(), "-db", "-f", str(self.config_path)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=end_with_parent,
            # Not the terminal's Ctrl-C: HAProxy would drop every stream at once, before the
            # replicas' final responses; stop() ends it once they have.
            start_new_session=True,
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
        return server_states(self.config.stats_port, backend)

    def wait_for_state(self, replica: str, state: str, timeout: float = 60.0) -> None:
        """Until the replica has `state` in both gRPC backends (each checks it on its own)."""
        deadline = time.time() + timeout
        while (current := {self.server_states(b).get(replica) for b in GRPC_BACKENDS}) != {state}:
            if time.time() > deadline:
                raise TimeoutError(f"{replica} is {current}, not {state}, after {timeout} s")
            time.sleep(0.2)

    def stop(self) -> None:
        terminate(self.process, timeout=10)
        self.log.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_states(stats_port: int, backend: str = "triton_grpc") -> dict[str, str]:
    """Replica name -> the status that the HAProxy with this stats port gives it in `backend`:
    UP, DOWN, 'UP 1/2' (rising), ... Also for a gateway that `serve` started in another
    process (loadtest/soak_replicas.py)."""
    url = f"http://127.0.0.1:{stats_port}/stats;csv"
    text = urllib.request.urlopen(url, timeout=5).read().decode().lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {
        row["svname"]: row["status"]
        for row in rows
        if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def write_config(
    config: GatewayConfig, env: dict[str, str], render: Callable[[GatewayConfig], str]
) -> dict[str, str]:
    """config.run_dir/haproxy.cfg (and the client keys, owner-only), checked by HAProxy.
    Returns HAProxy's environment: `env` and Triton's key, which the file only names."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    if config.security.keys:
        write_private(config.keys_path, "".join(f"{key}\n" for key in config.security.keys))
    config.config_path.write_text(render(config))
    haproxy_env = {**env, **config.security.haproxy_env()}
    check_config(config.config_path, haproxy_env)
    return haproxy_env


def write_private(path: Path, text: str) -> None:
    """A file only its owner can read, whatever umask says (the client keys)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an older file keeps its mode through O_CREAT
    with os.fdopen(descriptor, "w") as file:
        file.write(text)


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
    meanwhile). openai: the OpenAI-compatible API too, calling the gateway. Returns 2, with one
    line on stderr and nothing started, when the settings are refused: a gateway setting is
    wrong, or the replicas' engines together need more memory than their device has free
    (specdec/serving/memory_check.py)."""
    if (settings := gateway_settings(env, openai)) is None:
        return 2
    # The replicas share this host's device (each reads the same DEVICE): N servers' memory.
    if not memory_fits(env, num_replicas):
        return 2
    security, client_env = settings
    run_dir = Path(env.get("RUN_DIR", PROJECT_ROOT / ".run"))
    base = int(env.get("REPLICA_BASE_PORT", 8100))
    replicas = [replica_ports(i, base) for i in range(num_replicas)]
    config = GatewayConfig(
        replicas,
        grpc_port=int(env.get("GRPC_PORT", 8001)),
        http_port=int(env.get("HTTP_PORT", 8000)),
        stats_port=int(env.get("GATEWAY_STATS_PORT", 8404)),
        run_dir=run_dir / "gateway",
        security=security,
    )
    stopping: list[int] = []  # before any child starts: a signal stops them all
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, _frame: stopping.append(signum))
    processes = {r.name: start_replica(r, env, run_dir / r.name) for r in replicas}
    companions = []
    if openai:  # it reads GRPC_PORT and HTTP_PORT: the gateway's
        command = [sys.executable, "-m", "specdec.openai_api"]
        companions.append(subprocess.Popen(command, env=client_env, preexec_fn=end_with_parent))
    with Gateway(config) as gateway:
        _print_layout(config, run_dir)
        while not stopping:
            time.sleep(0.2)  # a signal is passed on within this
            for replica in replicas:
                code = processes[replica.name].poll()
                if code is not None and not stopping:
                    print(f"{replica.name} exited ({code}); starting it again", flush=True)
                    processes[replica.name] = start_replica(replica, env, run_dir / replica.name)
        children = [*processes.values(), *companions]
        for process in children:
            process.send_signal(signal.SIGTERM)
        for process in children:  # each stops within its own grace (specdec/launch.py)
            process.wait()
        gateway.stop()
    return 0


def gateway_settings(
    env: dict[str, str], openai: bool = False
) -> tuple[GatewaySecurity, dict[str, str]] | None:
    """The gateway's settings (docs/scaling.md, Security) and the OpenAI API's environment
    (`serve --openai`), checked before anything starts: None after one line on stderr that
    names what is wrong (a variable, never a key's value)."""
    if haproxy_binary() is None:
        print("haproxy not found: apt-get install haproxy", file=sys.stderr)
        return None
    try:
        security = GatewaySecurity.from_env(env)
        return security, (openai_env(env, security) if openai else env)
    except ValueError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return None


def compose(env: dict[str, str]) -> int:
    """The gateway of docker-compose.yml, in its container: HAProxy in this process's place
    (exec, so that docker's signals reach it). Returns 2 when a setting is refused."""
    if (command := compose_command(env)) is None:
        return 2
    argv, haproxy_env = command
    os.execve(argv[0], argv, haproxy_env)


def compose_command(env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """HAProxy's command line and environment in front of COMPOSE_SERVICES, its file written
    and checked, with the settings of `env` checked as `serve` checks them: None after one
    line on stderr naming what is wrong."""
    if (settings := gateway_settings(env)) is None:
        return None
    run_dir = Path(env.get("RUN_DIR", PROJECT_ROOT / ".run")) / "gateway"
    config = compose_config(settings[0], run_dir)
    try:  # e.g. a certificate that does not match its key: HAProxy's own message
        haproxy_env = write_config(config, env, render_compose_config)
    except ValueError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return None
    ports = f"gRPC {config.grpc_port}, HTTP {config.http_port}, stats {config.stats_port}"
    print(f"gateway (HAProxy) in front of {', '.join(r.name for r in config.replicas)}: {ports}")
    print(f"  security: {describe(config.security)}", flush=True)
    return [require_haproxy(), "-db", "-f", str(config.config_path)], haproxy_env


def openai_env(env: dict[str, str], security: GatewaySecurity) -> dict[str, str]:
    """The OpenAI API calls the gateway as a client: TLS when the gateway serves it, trusting
    GRPC_SSL_ROOT_CERT; with Triton's key, which the gateway accepts without a bound."""
    if security.keys and not security.triton_key:
        raise ValueError(
            "TRITON_INFERENCE_KEY: not set, and GATEWAY_KEYS_FILE is: the OpenAI API "
            "(--openai) calls the gateway with it"
        )
    if security.ssl_cert is None:
        return {k: v for k, v in env.items() if k != "GRPC_SSL_ROOT_CERT"}
    if not env.get("GRPC_SSL_ROOT_CERT"):
        raise ValueError(
            "GRPC_SSL_ROOT_CERT: not set, and GATEWAY_SSL_CERT is: the OpenAI API (--openai) "
            "trusts the gateway's certificate through it"
        )
    return env


def _print_layout(config: GatewayConfig, run_dir: Path) -> None:
    print(
        f"gateway (HAProxy) on {config.address}: gRPC {config.grpc_port}, HTTP "
        f"{config.http_port}, stats http://{config.address}:{config.stats_port}/stats",
        flush=True,
    )
    print(f"  security: {describe(config.security)}", flush=True)
    for r in config.replicas:
        ready = "ready" if is_ready(r.http_port) else "starting"
        print(
            f"  {r.name}: HTTP {r.http_port}, gRPC {r.grpc_port}, metrics {r.metrics_port} "
            f"({ready}; log {run_dir / r.name / 'server.log'})",
            flush=True,
        )
