"""The Triton server's configuration from the environment, the model repository rendered with
it, and the tritonserver command line (the 2.51 binary of PyPI's nvidia-pytriton, on the CPU).

The settings of the models (checkpoints, ENGINE, DEVICE, DTYPE, NUM_SLOTS, MAX_CONTEXT,
PROPOSERS, ...) and the keys and TLS files that lock Triton (TRITON_INFERENCE_KEY,
TRITON_ADMIN_KEY, GRPC_SSL_CERT, GRPC_SSL_KEY; docs/operations.md, Security) are declared in
one place, specdec/serving/settings.py (the table: docs/operations.md, Settings). Each one
set is parsed through its declaration here, so a bad value stops the server before it starts,
naming the variable. The repository in model_repository/ is rendered into RUN_DIR with every
declared parameter of each model written into its config.pbtxt (the variable's value, else
the declared default), checkpoint paths made absolute; docker compose renders it the same
way (docker/triton_entrypoint.py).

Beside them: HTTP_PORT, GRPC_PORT, METRICS_PORT (8000, 8001, 8002) and RUN_DIR (.run). The
keys are on tritonserver's command line (visible in the process list to users of the host);
nothing of ours prints them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specdec.certificates import check_dates, check_key_pair
from specdec.paths import PROJECT_ROOT
from specdec.processes import end_with_parent
from specdec.serving.settings import (
    BLS_MODEL,
    DRAFT_CHECKPOINT,
    DRAIN_VARIABLE,
    SETTINGS,
    TARGET_CHECKPOINT,
    model_settings,
)
from specdec.triton_access import INFERENCE_KEY_HEADER

CHECKPOINTS = (TARGET_CHECKPOINT, DRAFT_CHECKPOINT)  # relative: made absolute when rendered
# Triton's restricted API groups (a group may appear in one restriction only). The inference
# key locks what a client of the models calls: inference, the metadata and config our OpenAI
# API and perf_analyzer read first (the config names checkpoint paths), and the statistics.
# Health stays open for probes, the gateway's checks and the BLS's own readiness check.
INFERENCE_APIS = "inference,metadata,model-config,statistics"
ADMIN_APIS = "model-repository,shared-memory,trace,logging"
ADMIN_KEY_HEADER = "admin-key"
SOURCE_REPOSITORY = PROJECT_ROOT / "model_repository"


@dataclass
class ServerConfig:
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "127.0.0.1"
    run_dir: Path = PROJECT_ROOT / ".run"
    source_repository: Path = SOURCE_REPOSITORY
    # The declared settings set in the environment: model name -> {parameter: value}
    parameters: dict[str, dict[str, str]] = field(default_factory=dict)
    # On SIGTERM / SIGINT, running streams get drain_s to finish, then end with "server is
    # shutting down" (speculative_decoding). The launcher ends a tritonserver still running
    # stop_s after the signal: by then only clients that keep their gRPC streams open after
    # the final response hold it (Triton 2.51 waits for them), and Triton's own exit timeout,
    # later, would end it with an error. So `make serve` stops within 10 s
    # (docs/operations.md, Faults).
    drain_s: float = 2.0
    stop_s: float = 7.0
    exit_timeout_s: int = 9
    inference_key: str | None = field(default=None, repr=False)  # TRITON_INFERENCE_KEY
    admin_key: str | None = field(default=None, repr=False)  # TRITON_ADMIN_KEY
    grpc_ssl_cert: Path | None = None  # GRPC_SSL_CERT, with GRPC_SSL_KEY: gRPC over TLS
    grpc_ssl_key: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerConfig:
        """Raises ValueError naming the variable for a bad value of a declared setting."""
        env = dict(os.environ if env is None else env)
        parameters: dict[str, dict[str, str]] = {}
        for setting in SETTINGS:
            text = setting.from_env(env)  # checked; None: unset
            if text is not None:
                for model in setting.models:
                    parameters.setdefault(model, {})[setting.key] = text
        if bool(env.get("GRPC_SSL_CERT")) != bool(env.get("GRPC_SSL_KEY")):
            given, missing = sorted(("GRPC_SSL_CERT", "GRPC_SSL_KEY"), key=lambda v: not env.get(v))
            raise ValueError(f"{missing}: not set, and {given} is: TLS needs both")
        config = cls(
            http_port=int(env.get("HTTP_PORT", 8000)),
            grpc_port=int(env.get("GRPC_PORT", 8001)),
            metrics_port=int(env.get("METRICS_PORT", 8002)),
            parameters=parameters,
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


PARAMETER_LINE = 'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
PBTXT_STRING = r'"((?:[^"\\]|\\.)*)"'  # a quoted protobuf text string, escapes included


def parameter_pattern(key: str) -> re.Pattern[str]:
    return re.compile(
        r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*' + PBTXT_STRING
    )


def set_parameter(config_text: str, key: str, value: str) -> str:
    """The config.pbtxt with parameter `key` set to `value`: replaced where it has the
    parameter, else added as a line of its own at the end."""
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')
    pattern = parameter_pattern(key)
    if pattern.search(config_text):
        start = 'key: "' + key + '" value: { string_value: "'
        return pattern.sub(lambda _: start + quoted + '"', config_text)
    return config_text.rstrip("\n") + "\n" + PARAMETER_LINE.format(key=key, value=quoted) + "\n"


def get_parameter(config_text: str, key: str) -> str | None:
    """The string_value of parameter `key` in a config.pbtxt, None where it has none."""
    match = parameter_pattern(key).search(config_text)
    return None if match is None else re.sub(r"\\(.)", r"\1", match.group(1))


def render_repository(config: ServerConfig) -> Path:
    """Copies the model repository into run_dir, every declared parameter of each model
    written into its config.pbtxt: the value set in `config`, else the one its config.pbtxt
    carries, else the declared default; checkpoint paths made absolute."""
    target = config.run_dir / "model_repository"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(config.source_repository, target, ignore=shutil.ignore_patterns("__pycache__"))
    for config_file in target.glob("*/config.pbtxt"):
        model = config_file.parent.name
        text = config_file.read_text()
        given = config.parameters.get(model, {})
        for setting in model_settings(model):
            value = given.get(setting.key, get_parameter(text, setting.key))
            if value is None:
                value = setting.default
            if setting in CHECKPOINTS and not Path(value).is_absolute():
                value = str(PROJECT_ROOT / value)
            text = set_parameter(text, setting.key, value)
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
    env[DRAIN_VARIABLE] = str(config.drain_s)
    return command, env


def max_draft_tokens(source_repository: Path) -> int:
    """speculative_decoding's max_num_draft_tokens (its config.pbtxt, which the BLS requires):
    one less than the widest verify."""
    path = source_repository / BLS_MODEL / "config.pbtxt"
    value = get_parameter(path.read_text(), "max_num_draft_tokens")
    if value is None:
        raise ValueError(f"{path}: no max_num_draft_tokens parameter")
    return int(value)


def memory_fits(
    env: Mapping[str, str], replicas: int = 1, source_repository: Path = SOURCE_REPOSITORY
) -> bool:
    """Whether the engines of the settings in `env` fit their device's free memory, `replicas`
    servers together (specdec/serving/memory_check.py); False after its one line on stderr.
    A child process: it imports torch and may ask CUDA, which this process, alive as long
    as the server, should not carry (a CUDA context costs about 0.5 GiB of the GPU)."""
    command = [sys.executable, "-m", "specdec.serving.memory_check", "--replicas", str(replicas)]
    command += ["--max-draft-tokens", str(max_draft_tokens(source_repository))]
    # A session of its own: Ctrl-C reaches the launcher, which stops once the check is over,
    # and not this child, where it would print a KeyboardInterrupt from inside torch's import.
    return subprocess.run(command, env=dict(env), start_new_session=True).returncode == 0


def start(config: ServerConfig, log_file=None) -> subprocess.Popen:
    """tritonserver as a child process; it gets SIGTERM when this process dies."""
    command, env = server_command(config)
    return subprocess.Popen(
        command, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=end_with_parent
    )
