"""`ManagedServer`: a real Triton server of our own on free loopback ports, for tests,
benchmarks and tools; it is ready when the constructor returns (Triton ready, and the loop's
start-up cost measurement over: specdec/loop/calibration.py) and `stop()` ends it.

    with ManagedServer("my-check", {"PROPOSERS": "ngram"}) as server:
        generate("Hello", url=server.url)  # gRPC; server.metrics_url: Prometheus

Its run folder is .run/<name> (the rendered repository and server.log).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdec.paths import PROJECT_ROOT
from specdec.processes import (
    descendant_pids,
    end_with_parent,
    free_port,
    is_ready,
    terminate,
    tree_resident_bytes,
)
from specdec.server_config import ServerConfig, max_draft_tokens, start
from specdec.serving.metric_names import CALIBRATED


def check_memory(env: dict[str, str], config: ServerConfig) -> None:
    """The launcher's memory check of `env`'s settings, in this process (tests import torch
    anyway): raises specdec.engines.memory.MemoryRefused with its one line."""
    from specdec.serving.memory_check import check_environment

    check_environment(env, max_draft_tokens=max_draft_tokens(config.source_repository))


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
        container's command), so `process` is the supervisor. Settings whose engines do not
        fit the device raise MemoryRefused (the launcher's line) before anything starts."""
        ports = {k: str(free_port()) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
        run_dir = PROJECT_ROOT / ".run" / name
        env = {**ports, **(env or {}), "RUN_DIR": str(run_dir)}
        self.config = ServerConfig.from_env(env)
        if not supervised:  # specdec.launch checks it there
            check_memory(env, self.config)
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
                    f"tritonserver exited with {self.process.returncode}; see {self.log_path}, "
                    f"which ends:\n{self.log_tail()}"
                )
            if self.ready and self.calibrated:
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout} s; see {self.log_path}")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of server.log, for an error raised where the log is out of reach
        (a CI machine)."""
        self.log.flush()
        text = self.log_path.read_bytes().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config.metrics_port}/metrics"

    @property
    def ready(self) -> bool:
        return is_ready(self.config.http_port)

    @property
    def calibrated(self) -> bool:
        """The loop's start-up cost measurement is over (specdec_calibrated is 1)."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return False
        return any(
            line.startswith(CALIBRATED + "{") and line.split()[-1] == "1"
            for line in text.splitlines()
        )

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
        terminate(self.process, timeout=60)
        self.log.close()

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
