"""A tritonclient gRPC client for the ensemble and the BLS (used by clients/, tests, benchmarks).

Decoupled models answer only on gRPC streams, so every request goes through one; `stream`
decides whether the server sends one response per iteration or one at the end. Responses
are read as TensorRT-LLM's clients read them: `text_output` is 1-D (one element per
response), the other outputs [1, 1]; a request of several prompts or sequences is put back
together by batch_index and sequence_index.
"""

from __future__ import annotations

import queue
import re
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specdec.serving.responses import PERF_OUTPUTS
from specdec.triton_access import SESSION_HEADER, TritonAccess

INPUT_TYPES: dict[str, tuple[str, type]] = {
    "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", np.bool_),
    "stream_interval": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "random_seed": ("UINT64", np.uint64),
    "min_tokens": ("INT32", np.int32),
    "min_length": ("INT32", np.int32),
    "end_id": ("INT32", np.int32),
    "pad_id": ("INT32", np.int32),
    "beam_width": ("INT32", np.int32),
    "num_return_sequences": ("INT32", np.int32),
    "num_draft_tokens": ("INT32", np.int32),
    "fixed_num_draft_tokens": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
    "return_perf_metrics": ("BOOL", np.bool_),
    "return_num_input_tokens": ("BOOL", np.bool_),
    "return_num_output_tokens": ("BOOL", np.bool_),
    "repetition_penalty": ("FP32", np.float32),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "length_penalty": ("FP32", np.float32),
    "return_log_probs": ("BOOL", np.bool_),
    "return_context_logits": ("BOOL", np.bool_),
    "return_generation_logits": ("BOOL", np.bool_),
    "use_draft_logits": ("BOOL", np.bool_),
    "min_p": ("FP32", np.float32),
    "prompt_ignore_length": ("INT32", np.int32),
}
# Inputs that take a list, shaped [B, n]: their type, or None for text.
LIST_INPUT_TYPES: dict[str, tuple[str, type] | None] = {
    "stop_words": None,
    "bad_words": None,
    "proposer": None,
    "cache_salt": None,
    "embedding_bias_words": None,
    "embedding_bias_weights": ("FP32", np.float32),
    "logit_bias_ids": ("INT32", np.int32),
    "logit_bias_values": ("FP32", np.float32),
    "guided_decoding_guide_type": None,  # one string each
    "guided_decoding_guide": None,
}
METRIC_OUTPUTS = (*PERF_OUTPUTS, "num_input_tokens", "num_output_tokens", "cum_log_probs")
STREAM_ERROR_WAIT_S = 5.0  # for the reason a stream refused as it opened


def build_inputs(prompt: str | bytes | list, **params) -> list[grpcclient.InferInput]:
    """Input tensors shaped [B, 1] as TensorRT-LLM's ensemble takes them: B = 1 for one
    prompt, or one row per prompt of a list (every parameter repeated on each row)."""
    prompts = prompt if isinstance(prompt, list) else [prompt]
    rows = len(prompts)
    raw = [p.encode("utf-8") if isinstance(p, str) else p for p in prompts]
    text = grpcclient.InferInput("text_input", [rows, 1], "BYTES")
    text.set_data_from_numpy(np.array(raw, dtype=np.object_).reshape(rows, 1))
    inputs = [text]
    for name, value in params.items():
        if value is None:
            continue
        if name in LIST_INPUT_TYPES:
            value = [value] if isinstance(value, str | int | float) else list(value)
            numeric = LIST_INPUT_TYPES[name]
            if numeric is None:
                array = np.array([[w.encode("utf-8") for w in value]] * rows, dtype=np.object_)
            else:
                array = np.array([value] * rows, dtype=numeric[1]).reshape(rows, len(value))
            tensor = grpcclient.InferInput(
                name, list(array.shape), "BYTES" if numeric is None else numeric[0]
            )
            tensor.set_data_from_numpy(array)
        else:
            triton_type, dtype = INPUT_TYPES[name]
            tensor = grpcclient.InferInput(name, [rows, 1], triton_type)
            tensor.set_data_from_numpy(np.full((rows, 1), value, dtype=dtype))
        inputs.append(tensor)
    return inputs


def requested_outputs(**params) -> list[grpcclient.InferRequestedOutput]:
    """text_output, the indices, and what the request's return_* flags ask for (asking for
    every output by default would make the server build each of them)."""
    names = ["text_output", "batch_index", "sequence_index"]
    if params.get("return_log_probs"):
        names += ["cum_log_probs", "output_log_probs"]
    if params.get("return_perf_metrics"):
        names += list(PERF_OUTPUTS)
    for name in ("num_input_tokens", "num_output_tokens"):
        if params.get(f"return_{name}"):
            names.append(name)
    return [grpcclient.InferRequestedOutput(name) for name in names]


@dataclass
class GenerationResult:
    text: str = ""  # all chunks joined
    chunks: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since the request left
    metrics: dict[str, float] = field(default_factory=dict)  # acceptance_rate, ...
    output_log_probs: list[float] = field(default_factory=list)  # with return_log_probs
    error: InferenceServerException | None = None
    elapsed: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


class StreamingClient:
    """One gRPC stream; `generate` sends one request on it and collects its responses."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = "ensemble",
        access: TritonAccess | None = None,  # default: from the environment
        session_id: str | None = None,  # a gateway keeps a session's streams on one replica
    ) -> None:
        self.url = url
        self.model = model
        access = TritonAccess.from_env() if access is None else access
        self.client = grpcclient.InferenceServerClient(url, **access.client_kwargs)
        self.responses: queue.Queue = queue.Queue()
        headers = dict(access.headers or {})
        if session_id:
            headers[SESSION_HEADER] = session_id
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error)),
            headers=headers or None,
        )

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, prompt: str | bytes, timeout: float = 300.0, on_chunk=None, **params
    ) -> GenerationResult:
        """One prompt, one sequence."""
        return self.generate_all(prompt, timeout, on_chunk, **params)[(0, 0)]

    def generate_all(
        self, prompt: str | bytes | list, timeout: float = 300.0, on_chunk=None, **params
    ) -> dict[tuple[int, int], GenerationResult]:
        """One request of one prompt or a list of them: a result per (batch_index,
        sequence_index). An error ends the request: every result carries it."""
        results: dict[tuple[int, int], GenerationResult] = {}
        start = time.perf_counter()
        try:
            self.client.async_stream_infer(
                self.model,
                build_inputs(prompt, **params),
                outputs=requested_outputs(**params),
                enable_empty_final_response=True,
            )
        except InferenceServerException as ended:
            # The stream ended as it opened (a locked Triton refused it: no key, TLS); the
            # reason reaches the callback a moment later. Without one, this stream is spent.
            try:
                _, error = self.responses.get(timeout=STREAM_ERROR_WAIT_S)
            except queue.Empty:
                raise ended from None
            return {(0, 0): GenerationResult(error=error or ended)}
        while True:
            response, error = self.responses.get(timeout=timeout)
            now = time.perf_counter() - start
            if error is not None:
                for result in results.values() or [results.setdefault((0, 0), GenerationResult())]:
                    result.error = error
                break
            final = response.get_response().parameters.get("triton_final_response")
            if response.as_numpy("text_output") is not None:  # not the empty final one
                result = results.setdefault(_indices(response), GenerationResult())
                self._collect(response, result, now, on_chunk)
                result.elapsed = now
            if final is not None and final.bool_param:
                break
        for result in results.values():
            result.text = "".join(result.chunks)
        return results

    @staticmethod
    def _collect(response, result: GenerationResult, now: float, on_chunk) -> None:
        chunk = response.as_numpy("text_output")[0].decode("utf-8")  # 1-D, one sequence
        if chunk:
            result.chunks.append(chunk)
            result.chunk_times.append(now)
            if on_chunk is not None:
                on_chunk(chunk)
        for name in METRIC_OUTPUTS:
            value = response.as_numpy(name)
            if value is not None:
                result.metrics[name] = value[0][0].item()
        log_probs = response.as_numpy("output_log_probs")
        if log_probs is not None:
            result.output_log_probs += log_probs[0][0].tolist()  # (1, 1, new tokens)


def _indices(response) -> tuple[int, int]:
    """(batch_index, sequence_index) of a response; 0 where the server sent none."""
    values = []
    for name in ("batch_index", "sequence_index"):
        value = response.as_numpy(name)
        values.append(0 if value is None else int(value[0][0]))
    return values[0], values[1]


def generate(
    prompt: str | bytes,
    url: str = "127.0.0.1:8001",
    model: str = "ensemble",
    session_id: str | None = None,
    **params,
) -> GenerationResult:
    """One request on a fresh stream."""
    with StreamingClient(url, model, session_id=session_id) as client:
        return client.generate(prompt, **params)


def scrape_metrics(url: str) -> dict[str, float]:
    """The specdec_ series of a metrics endpoint: {'name{labels}': value}, model label dropped."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(specdec_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            labels = re.sub(r',?model="[^"]*"', "", match.group(2) or "").replace("{,", "{")
            key = match.group(1) + ("" if labels in ("", "{}") else labels)
            values[key] = float(match.group(3))
    return values


def wait_until_idle(metrics_url: str, timeout: float = 900.0) -> None:
    """Until the loop has nothing running or queued: abandoned streams to the ensemble go on
    until they finish (an ensemble step does not hear of a cancellation)."""
    deadline = time.monotonic() + timeout
    while True:
        values = scrape_metrics(metrics_url)
        if not values.get("specdec_running_batch_size") and not values.get(
            "specdec_queued_requests"
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"server still busy after {timeout} s: {metrics_url}")
        time.sleep(1.0)
