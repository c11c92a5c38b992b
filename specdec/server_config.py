"""The Triton server's configuration from the environment, the model repository rendered with
it, and the tritonserver command line (the 2.51 binary of PyPI's nvidia-pytriton, on the CPU).

Environment: HTTP_PORT, GRPC_PORT, METRICS_PORT (8000, 8001, 8002), ENGINE (torch,
onnxruntime or tensorrt; specdec/engines/select.py), DEVICE (torch engine: cpu or cuda), DTYPE
(the engines' precision: float32, bfloat16, float16 or auto; unset: the committed float32),
CUDA_GRAPHS (true: the torch engine on CUDA replays its decode steps as CUDA graphs),
DRAFT_ENGINE_DIR, TARGET_ENGINE_DIR (exported engines; default: built on demand under
.run/engines), TARGET_CHECKPOINT, DRAFT_CHECKPOINT (HF directories), NUM_SLOTS, MAX_CONTEXT,
DEFAULT_NUM_DRAFT_TOKENS, MAX_QUEUE, PROPOSERS (draft_model,ngram), RESPONSE_THREAD (auto,
true or false: send each iteration's responses on a thread beside the loop; auto: with 4 or
more usable cores; specdec/serving/outbox.py), STREAM_INTERVAL (1: output tokens a streamed
sequence gathers between responses, for requests that send no stream_interval),
CALIBRATION_SECONDS (5: the start-up cost measurement's budget, 0 = off;
specdec/loop/calibration.py), PREFIX_CACHE (on or off: prompts start from cached or running
sequences' caches; specdec/loop/prefix_cache.py), PREFIX_MIN_TOKENS (64: the shortest prefix
reused), PREFILL_CHUNK (256: a longer prompt joins in chunks of this many tokens per step; 0 =
off), RUN_DIR (.run). STREAM_INTERVAL, RESPONSE_THREAD, CUDA_GRAPHS, CALIBRATION_SECONDS, the
PREFIX_ settings and PREFILL_CHUNK are checked here, before the server starts
(specdec/serving/settings.py). The repository in model_repository/ is rendered into RUN_DIR
with these values, so the committed configs stay usable as they are (docker compose mounts
them).

Access (docs/operations.md, Security; checked before the server starts as well):
TRITON_INFERENCE_KEY (Triton's inference, metadata, model-config and statistics APIs answer
only requests with the header `inference-key: <value>`; gRPC clients send it as
`triton-grpc-protocol-inference-key`, specdec/triton_access.py), TRITON_ADMIN_KEY (the same
for the model-repository, shared-memory, trace and logging APIs, header `admin-key`),
GRPC_SSL_CERT and GRPC_SSL_KEY (PEM files: gRPC over TLS). Health and metrics stay open.
The keys are on tritonserver's command line (visible in the process list to users of the
host); nothing of ours prints them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from specdec.certificates import check_dates, check_key_pair
from specdec.paths import PROJECT_ROOT
from specdec.processes import end_with_parent
from specdec.serving.settings import ENV_CHECKS
from specdec.triton_access import INFERENCE_KEY_HEADER

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
    "CUDA_GRAPHS": ("cuda_graphs", ENGINE_MODELS),  # true: torch on CUDA replays CUDA graphs
    "DRAFT_ENGINE_DIR": ("engine_dir", ("draft_model",)),
    "TARGET_ENGINE_DIR": ("engine_dir", ("target_model",)),
    "TARGET_CHECKPOINT": ("checkpoint", ("target_model", "preprocessing") + BLS_MODELS),
    "DRAFT_CHECKPOINT": ("checkpoint", ("draft_model",)),
    "MAX_QUEUE": ("max_queue", BLS_MODELS),
    "RESPONSE_THREAD": ("response_thread", BLS_MODELS),  # auto, true, false
    "STREAM_INTERVAL": ("stream_interval", BLS_MODELS),
    "DEFAULT_NUM_DRAFT_TOKENS": ("default_num_draft_tokens", BLS_MODELS),
    "CALIBRATION_SECONDS": ("calibration_seconds", BLS_MODELS),  # 0: no start-up measurement
    "PREFIX_CACHE": ("prefix_cache", BLS_MODELS),  # on, off
    "PREFIX_MIN_TOKENS": ("prefix_min_tokens", BLS_MODELS),
    "PREFILL_CHUNK": ("prefill_chunk", BLS_MODELS),  # 0: prompts prefill whole
}
# Triton's restricted API groups (a group may appear in one restriction only). The inference
# key locks what a client of the models calls: inference, the metadata and config our OpenAI
# API and perf_analyzer read first (the config names checkpoint paths), and the statistics.
# Health stays open for probes, the gateway's checks and the BLS's own readiness check.
INFERENCE_APIS = "inference,metadata,model-config,statistics"
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
ADMIN_KEY_HEADER = "admin-key"


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
    inference_key: str | None = field(default=None, repr=False)  # TRITON_INFERENCE_KEY
    admin_key: str | None = field(default=None, repr=False)  # TRITON_ADMIN_KEY
    grpc_ssl_cert: Path | None = None  # GRPC_SSL_CERT, with GRPC_SSL_KEY: gRPC over TLS
    grpc_ssl_key: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerConfig:
        """Raises ValueError naming the variable for a bad value of one in ENV_CHECKS."""
        env = dict(os.environ if env is None else env)
        for var, check in ENV_CHECKS.items():
            if env.get(var):
                check(var, env[var])
        if bool(env.get("GRPC_SSL_CERT")) != bool(env.get("GRPC_SSL_KEY")):
            given, missing = sorted(("GRPC_SSL_CERT", "GRPC_SSL_KEY"), key=lambda v: not env.get(v))
            raise ValueError(f"{missing}: not set, and {given} is: TLS needs both")
        config = cls(
            http_port=int(env.get("HTTP_PORT", 8000)),
            grpc_port=int(env.get("GRPC_PORT", 8001)),
            metrics_port=int(env.get("METRICS_PORT", 8002)),
            inference_key=env.get("TRITON_INFERENCE_KEY") or None,
            admin_key=env.get("TRITON_ADMIN_KEY") or None,
        )
        if env.get("GRPC_SSL_CERT"):
            cert, key = env["GRPC_SSL_CERT"], env["GRPC_SSL_KEY"]
            check_dates("GRPC_SSL_CERT", cert)  # refused here, not at each client's handshake
            check_key_pair("GRPC_SSL_CERT", cert, "GRPC_SSL_KEY", key)
            config.grpc_ssl_cert, config.grpc_ssl_key = Path(cert).absolute(), Path(key).absolute()
        if env.get("RUN_DIR"):
            config.run_dir = Path(env["RUN_DIR"])
        for var, (key, models) in ENV_PARAMETERS.items():
            if env.get(var):
                for model in models:
                    config.parameters.setdefault(model, {})[key] = env[var]
        if "PROPOSERS" in env:  # "" is a value: no speculation
            config.parameters.setdefault("speculative_decoding", {})["proposers"] = env["PROPOSERS"]
        return config


def access_arguments(config: ServerConfig) -> list[str]:
    """tritonserver's options for the keys and TLS set in `config` (none when unset)."""
    arguments = []
    for apis, header, key in (
        (INFERENCE_APIS, INFERENCE_KEY_HEADER, config.inference_key),
        (ADMIN_APIS, ADMIN_KEY_HEADER, config.admin_key),
    ):
        if key:
            arguments.append(f"--http-restricted-api={apis}:{header}={key}")
            arguments.append(f"--grpc-restricted-protocol={apis}:{header}={key}")
    if config.grpc_ssl_cert and config.grpc_ssl_key:
        arguments += [
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={config.grpc_ssl_cert}",
            f"--grpc-server-key={config.grpc_ssl_key}",
        ]
    return arguments


def access_summary(config: ServerConfig) -> str:
    """What is locked, for a start-up line (never the keys themselves)."""
    locks = []
    if config.grpc_ssl_cert:
        locks.append("gRPC TLS")
    if config.inference_key:
        locks.append(f"inference needs the {INFERENCE_KEY_HEADER} header")
    if config.admin_key:
        locks.append(f"admin APIs need the {ADMIN_KEY_HEADER} header")
    return ", ".join(locks) or "no TLS, no keys"


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
    """The installed pytriton package's folder, found without importing it: its __init__
    imports its clients (gevent, zmq, ...), and only its tritonserver build is used here."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: run `make venv`")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


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
        *access_arguments(config),
    ]
    env = server_env()
    # speculative_decoding asks Triton's readiness on this port before its first BLS call
    # (specdec/serving/bls_model.py, the start-up cost measurement).
    env["SPECDEC_HTTP_PORT"] = str(config.http_port)
    return command, env


def start(config: ServerConfig, log_file=None) -> subprocess.Popen:
    """tritonserver as a child process; it gets SIGTERM when this process dies."""
    command, env = server_command(config)
    return subprocess.Popen(
        command, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=end_with_parent
    )
