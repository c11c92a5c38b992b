"""Helpers for tests against a live server: metrics scrapes, long streams, waiting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import tritonclient.grpc as grpcclient

from specdec.client import build_inputs, generate
from specdec.client import scrape_metrics as scrape  # noqa: F401 - the tests' name for it
from specdec.harness import ManagedServer
from specdec.processes import end_with_parent, free_port


def start_victim(url: str, prompt: str, max_tokens: int = 1000, model="speculative_decoding"):
    """A long stream (no end token); returns its client and the list its responses land in."""
    chunks = []
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: chunks.append((result, error)))
    client.async_stream_infer(
        model,
        build_inputs(prompt, max_tokens=max_tokens, stream=True, end_id=-1),
        enable_empty_final_response=True,
    )
    return client, chunks


def start_bystander(url: str, prompt: str, max_tokens: int, model="speculative_decoding") -> Future:
    """A greedy k = 2 request in the background, beside what a test does to the server;
    the test checks its text stays exact."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(
        generate,
        prompt,
        url=url,
        model=model,
        max_tokens=max_tokens,
        num_draft_tokens=2,
        fixed_num_draft_tokens=True,
        exclude_input_in_output=True,
    )
    pool.shutdown(wait=False)  # the request runs on; the pool takes no more
    return future


def is_final(result, error) -> bool:
    """An error, or a response flagged final (needs enable_empty_final_response)."""
    if error is not None:
        return True
    final = result.get_response().parameters.get("triton_final_response")
    return final is not None and final.bool_param


def wait_for(condition, timeout=120.0):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "condition not met"
        time.sleep(0.05)


@contextmanager
def openai_api_process(
    server: ManagedServer, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """`python -m specdec.openai_api` on a free port, calling `server`, with `env` added;
    yields its base URL (.../v1) once /health answers (it needs no key)."""
    port = free_port()
    env = {
        **os.environ,
        "OPENAI_PORT": str(port),
        "GRPC_PORT": str(server.config.grpc_port),
        **(env or {}),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "specdec.openai_api"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=end_with_parent,
        )
    try:
        deadline = time.monotonic() + 120
        while True:  # it listens once its backend has started
            assert process.poll() is None, log_path.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)
