"""Starts the real Triton server (the 2.51 binary of PyPI's nvidia-pytriton) on the CPU.

    python -m specdec.launch            # the server alone; Ctrl-C stops it
    python -m specdec.launch --openai   # `make serve`: and the OpenAI-compatible API beside it
    python -m specdec.launch --exit-when-unready   # containers: exit 1 when a stub died

Environment: HTTP_PORT, GRPC_PORT, METRICS_PORT (8000, 8001, 8002), ENGINE (torch,
onnxruntime or tensorrt; specdec/engines/select.py), DEVICE (torch engine: cpu or cuda), DTYPE
(the engines' precision: float32, bfloat16, float16 or auto; unset: the committed float32),
DRAFT_ENGINE_DIR, TARGET_ENGINE_DIR (exported engines; default: built on demand under
.run/engines), TARGET_CHECKPOINT, DRAFT_CHECKPOINT (HF directories), NUM_SLOTS, MAX_CONTEXT,
DEFAULT_NUM_DRAFT_TOKENS, MAX_QUEUE, PROPOSERS (draft_model,ngram), RESPONSE_THREAD (false:
send each iteration's responses on a thread beside the loop; specdec/serving/outbox.py),
RUN_DIR (.run). The
repository in model_repository/ is rendered into RUN_DIR with these values, so the committed
configs stay usable as they are (docker compose mounts them).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
ENGINE_MODELS = ("draft_model", "target_model")
BLS_MODELS = ("speculative_decoding",)
# Environment variables that set config.pbtxt parameters (when set and not empty):
# variable -> (parameter, the models that take it).
ENV_PARAMETERS = {
    "NUM_SLOTS": ("num_slots", ENGINE_MODELS + BLS_MODELS),
    "MAX_CONTEXT": ("max_context", ENGINE_MODELS + BLS_MODELS),
    "ENGINE": ("engine", ENGINE_MODELS),  # torch, onnxruntime, tensorrt
    "DEVICE": ("device", ENGINE_MODELS),  # the torch engine's: cpu, cuda
    "DTYPE": ("dtype", ENGINE_MODELS),  # float32, bfloat16, float16, auto
    "DRAFT_ENGINE_DIR": ("engine_dir", ("draft_model",)),
    "TARGET_ENGINE_DIR": ("engine_dir", ("target_model",)),
    "TARGET_CHECKPOINT": ("checkpoint", ("target_model", "preprocessing") + BLS_MODELS),
    "DRAFT_CHECKPOINT": ("checkpoint", ("draft_model",)),
    "MAX_QUEUE": ("max_queue", BLS_MODELS),
    "RESPONSE_THREAD": ("response_thread", BLS_MODELS),
    "DEFAULT_NUM_DRAFT_TOKENS": ("default_num_draft_tokens", BLS_MODELS),
}


@dataclass
class ServerConfig:
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "127.0.0.1"
    run_dir: Path = PROJECT_ROOT / ".run"
    source_repository: Path = PROJECT_ROOT / "model_repository"
    # config.pbtxt parameter overrides: model name -> {parameter: value}
    parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    exit_timeout_s: int = 30

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerConfig:
        env = dict(os.environ if env is None else env)
        config = cls(
            http_port=int(env.get("HTTP_PORT", 8000)),
            grpc_port=int(env.get("GRPC_PORT", 8001)),
            metrics_port=int(env.get("METRICS_PORT", 8002)),
        )
        if env.get("RUN_DIR"):
            config.run_dir = Path(env["RUN_DIR"])
        for var, (key, models) in ENV_PARAMETERS.items():
            if env.get(var):
                for model in models:
                    config.parameters.setdefault(model, {})[key] = env[var]
        if "PROPOSERS" in env:  # "" is a value: no speculation
            config.parameters.setdefault("speculative_decoding", {})["proposers"] = env["PROPOSERS"]
        return config


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replaces the string_value of parameter `key` in a config.pbtxt."""
    pattern = re.compile(
        r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*")[^"]*(")'
    )
    if not pattern.search(config_text):
        raise KeyError(f"parameter {key!r} not in config")
    return pattern.sub(lambda m: m.group(1) + value + m.group(2), config_text)


def render_repository(config: ServerConfig) -> Path:
    """Copies the model repository into run_dir with parameters applied and paths absolute."""
    target = config.run_dir / "model_repository"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(config.source_repository, target, ignore=shutil.ignore_patterns("__pycache__"))
    for config_file in target.glob("*/config.pbtxt"):
        model = config_file.parent.name
        text = config_file.read_text()
        for key, value in config.parameters.get(model, {}).items():
            text = set_parameter(text, key, value)
        match = re.search(r'key:\s*"checkpoint"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
        if match and not Path(match.group(1)).is_absolute():
            text = set_parameter(text, "checkpoint", str(PROJECT_ROOT / match.group(1)))
        config_file.write_text(text)
    return target


def pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).resolve().parent


def prepare_backend(run_dir: Path) -> Path:
    """A python backend folder with the stub for this interpreter (as the wheel needs)."""
    server = pytriton_dir() / "tritonserver"
    backend = run_dir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    sources = [
        server / "backends" / "python" / "libtriton_python.so",
        server / "backends" / "python" / "triton_python_backend_utils.py",
        server / "python_backend_stubs" / version / "triton_python_backend_stub",
    ]
    for source in sources:
        # Copy, then rename over: a stub still running from an old server keeps its file.
        partial = backend / (source.name + ".partial")
        shutil.copy2(source, partial)
        os.replace(partial, backend / source.name)
    return backend.parent


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(pytriton_dir().parent / "nvidia_pytriton.libs")]
    if sysconfig.get_config_var("LIBDIR"):
        libs.append(sysconfig.get_config_var("LIBDIR"))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    # The stub finds the venv's packages through PATH (PYTHONPATH alone did not work).
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("SPECDEC_HOME", str(PROJECT_ROOT))
    return env


def server_command(config: ServerConfig) -> tuple[list[str], dict[str, str]]:
    repository = render_repository(config)
    backends = prepare_backend(config.run_dir)
    binary = pytriton_dir() / "tritonserver" / "bin" / "tritonserver"
    command = [
        str(binary),
        f"--model-repository={repository}",
        f"--backend-directory={backends}",
        f"--http-address={config.address}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.address}",
        f"--metrics-port={config.metrics_port}",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=true",
        "--model-control-mode=none",
        f"--exit-timeout-secs={config.exit_timeout_s}",
        "--log-verbose=0",
    ]
    return command, server_env()


PR_SET_PDEATHSIG = 1


def end_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM when the process that
    started it dies, so a benchmark or test killed outright leaves no server behind to slow
    the next measurement down. Linux; elsewhere nothing happens."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start(config: ServerConfig, log_file=None) -> subprocess.Popen:
    command, env = server_command(config)
    return subprocess.Popen(
        command, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=end_with_parent
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def is_ready(http_port: int, host: str = "127.0.0.1") -> bool:
    """Triton's readiness: every model loaded and its stub alive."""
    try:
        url = f"http://{host}:{http_port}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:  # HTTPError (503: not ready) is an OSError too
        return False


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


class ManagedServer:
    """A server of our own on free loopback ports (tests, benchmarks); stop() ends it."""

    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
        supervised: bool = False,
    ):
        """supervised: run it as `python -m specdec.launch --exit-when-unready` does (the
        container's command), so `process` is the supervisor."""
        ports = {k: str(free_port()) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
        run_dir = PROJECT_ROOT / ".run" / name
        env = {**ports, **(env or {}), "RUN_DIR": str(run_dir)}
        self.config = ServerConfig.from_env(env)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.config.run_dir / "server.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        if supervised:
            command = [sys.executable, "-m", "specdec.launch", "--exit-when-unready"]
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdout=self.log,
                stderr=subprocess.STDOUT,
                preexec_fn=end_with_parent,
            )
        else:
            self.process = start(self.config, self.log)
        try:
            self._wait_ready(timeout)
        except Exception:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}; see {self.log_path}"
                )
            if self.ready:
                return
            time.sleep(1)
        raise TimeoutError(f"tritonserver not ready after {timeout} s; see {self.log_path}")

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config.metrics_port}/metrics"

    @property
    def ready(self) -> bool:
        return is_ready(self.config.http_port)

    def stub_pid(self, model: str) -> int:
        """The Python backend stub process that runs `model`."""
        marker = f"/model_repository/{model}/"
        for pid in descendant_pids(self.process.pid):
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
        raise LookupError(f"no stub process for {model}")

    def memory_bytes(self) -> int:
        """Resident memory of tritonserver and its stub processes together."""
        return tree_resident_bytes(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def process_alive(pid: int) -> bool:
    """Running (a killed child that its parent has not reaped yet is a zombie: not alive)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def supervise(
    command: list[str],
    env: dict[str, str],
    http_port: int,
    poll_s: float = 5.0,
    max_unready_polls: int = 3,
) -> int:
    """Runs tritonserver as a child and passes SIGTERM / SIGINT on. Once the server has been
    ready, a stub process that died, or `max_unready_polls` failed readiness checks in a row,
    stop it and return 1. Triton 2.51 neither restarts a dead Python stub nor stops reporting
    ready (its requests fail), so this process exits and a container restart policy
    (compose `restart: on-failure`) brings up a fresh server."""
    process = subprocess.Popen(command, env=env, preexec_fn=end_with_parent)
    stopping = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    stubs: list[int] = []  # the stub processes, once the server is ready
    misses = 0
    while process.poll() is None:
        time.sleep(poll_s)
        if stopping:
            continue
        ready = is_ready(http_port)
        if ready and not stubs:
            stubs = descendant_pids(process.pid)
        misses = 0 if ready or not stubs else misses + 1
        dead = [pid for pid in stubs if not process_alive(pid)]
        if dead or misses >= max_unready_polls:
            reason = f"stub process {dead[0]} died" if dead else "no longer ready"
            print(f"tritonserver: {reason}; stopping it", file=sys.stderr, flush=True)
            process.terminate()
            process.wait()
            return 1
    return process.returncode


def start_openai_api() -> subprocess.Popen:
    """specdec.openai_api as a child: it waits for the server to be ready, reads GRPC_PORT
    and OPENAI_PORT from the environment, and gets SIGTERM when this process ends (or the
    tritonserver that execs in its place)."""
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
    config = ServerConfig.from_env()
    if args.openai:
        start_openai_api()
    print(
        f"tritonserver on {config.address}: HTTP {config.http_port}, gRPC {config.grpc_port}, "
        f"metrics {config.metrics_port} (Ctrl-C stops it)",
        flush=True,
    )
    command, env = server_command(config)
    if args.exit_when_unready:
        sys.exit(supervise(command, env, config.http_port))
    os.execve(command[0], command, env)  # the server gets Ctrl-C itself and shuts down cleanly


if __name__ == "__main__":
    main()
