"""Shared fixtures: the real models, and real Triton servers started once per session."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from specdec.launch import PROJECT_ROOT, ServerConfig, start

MODELS = PROJECT_ROOT / "models"
TARGET = MODELS / "smollm2-135m-instruct"
DRAFT = MODELS / "smollm2-135m-first4layers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(http_port: int, process, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("tritonserver not ready")


class RunningServer:
    def __init__(self, name: str, env: dict[str, str]) -> None:
        ports = {k: str(_free_port()) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
        self.config = ServerConfig.from_env({**ports, **env})
        self.config.run_dir = PROJECT_ROOT / ".run" / name
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path: Path = self.config.run_dir / "server.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.process = start(self.config, self.log)
        try:
            _wait_ready(self.config.http_port, self.process)
        except Exception:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.config.metrics_port}/metrics"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except Exception:
            self.process.kill()
        self.log.close()


@pytest.fixture(scope="session")
def target_dir() -> Path:
    if not (TARGET / "config.json").exists():
        pytest.fail("models missing: run `make models` (make test does)")
    return TARGET


@pytest.fixture(scope="session")
def server(target_dir):
    """The default repository: 4-layer draft, torch engine, default k."""
    running = RunningServer("test-default", {"NUM_SLOTS": "32", "MAX_CONTEXT": "1024"})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def self_draft_server(target_dir):
    """Draft = target: every proposal is accepted."""
    running = RunningServer(
        "test-self-draft",
        {"DRAFT_CHECKPOINT": str(target_dir), "NUM_SLOTS": "8", "MAX_CONTEXT": "512"},
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def hf_target(target_dir):
    """The reference: Hugging Face transformers on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    return tokenizer, model


def hf_greedy_text(hf_target, prompt: str, max_new_tokens: int) -> str:
    import torch

    tokenizer, model = hf_target
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
