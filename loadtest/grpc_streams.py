"""Streamed generations for gevent load generators (Locust): many users, few gRPC channels.

Why not one tritonclient InferenceServerClient per user: under gRPC's gevent mode
(`grpc.experimental.gevent.init_gevent()`) every channel has a completion queue whose poll
(`completion_queue_next`, up to 2 s per call) runs in gevent's hub thread pool, 10 native
threads by default. With one channel per user, 256 users need 256 polls at once: 10 run,
the other channels' responses wait in the pool's task queue until a poll ahead of them
returns (an event or its 2 s timeout), and reach the users late and in bursts (see
docs/loadtest.md for the measurement). Here all users of a process share a few channels
(`StreamPool`), so only that many polls are ever outstanding, and every request is its own
`ModelStreamInfer` call on one of them: the poll that returns an event hands it to the
waiting user's greenlet at once. Arrival times are taken where the user's greenlet reads
each response from the call.

Outside gevent (plain threads) the same code works as ordinary blocking gRPC.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import grpc
import grpc._common
from tritonclient.grpc import InferResult, service_pb2_grpc
from tritonclient.grpc._utils import _get_inference_request

from specdec.client import METRIC_OUTPUTS, build_inputs, requested_outputs

# A user reading its stream waits for the next response on a condition, in slices of
# grpc._common.MAXIMUM_WAIT_TIMEOUT (0.1 s, so that a waiting main thread sees Ctrl-C). Each
# slice wakes the greenlet for nothing, and with hundreds of queued users that CPU is taken
# from the server being measured (what it cost: docs/loadtest.md, Locust's wake-ups). A
# response or the call's end still wakes the waiter at once (the condition is notified);
# Locust stops a user by killing its greenlet. GRPC_WAIT_SLICE_S=0.1: gRPC's own.
WAIT_SLICE_S = float(os.environ.get("GRPC_WAIT_SLICE_S", "5.0"))


def lengthen_grpc_wait_slices(seconds: float = WAIT_SLICE_S) -> None:
    if not hasattr(grpc._common, "MAXIMUM_WAIT_TIMEOUT"):
        raise RuntimeError("grpc._common.MAXIMUM_WAIT_TIMEOUT is gone: see grpc_streams.py")
    grpc._common.MAXIMUM_WAIT_TIMEOUT = seconds


# No limit on message sizes (as tritonclient's default channel), keep the connection alive.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 60_000),
]


@dataclass
class StreamResult:
    """One request's responses as they arrived. Times: time.time_ns() at arrival."""

    sent_ns: int = 0  # just before the request left
    chunk_ns: list[int] = field(default_factory=list)  # each response with new text
    chunk_tokens: list[int] = field(default_factory=list)  # output tokens so far, per chunk
    done_ns: int = 0  # the final response (or the error)
    text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # the last response's values
    error: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return int(self.metrics.get("num_output_tokens", 0))

    @property
    def time_to_first_token(self) -> float | None:
        return (self.chunk_ns[0] - self.sent_ns) / 1e9 if self.chunk_ns else None

    @property
    def elapsed(self) -> float:
        return (self.done_ns - self.sent_ns) / 1e9

    @property
    def server_time_to_first_token(self) -> float | None:
        """Arrival to first token as the server recorded it (return_perf_metrics)."""
        arrival = self.metrics.get("arrival_time_ns", 0)
        first = self.metrics.get("first_token_time_ns", 0)
        return (first - arrival) / 1e9 if arrival and first else None


class _OneRequest:
    """The request iterator of one call: yields the request, then holds the stream open
    until the final response (a decoupled model answers only while the stream is open)."""

    def __init__(self, request) -> None:
        self.request = request
        self.finished = threading.Event()

    def __iter__(self):
        yield self.request
        self.finished.wait()


class StreamPool:
    """`num_channels` gRPC channels to one server; `generate` runs one streamed request on
    the next channel in turn, from any greenlet or thread."""

    def __init__(self, url: str, model: str = "ensemble", num_channels: int = 4) -> None:
        lengthen_grpc_wait_slices()
        self.model = model
        self.channels = [
            grpc.insecure_channel(url, options=CHANNEL_OPTIONS) for _ in range(num_channels)
        ]
        self.stubs = itertools.cycle(
            [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in self.channels]
        )

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def generate(
        self, prompt: str, timeout: float = 600.0, on_chunk=None, **params
    ) -> StreamResult:
        """One request (one prompt, one sequence); its responses timed as they arrive.
        `on_chunk(result)` runs after each response with new text."""
        request = _get_inference_request(
            model_name=self.model,
            inputs=build_inputs(prompt, **params),
            model_version="",
            request_id="",
            outputs=requested_outputs(**params),
            sequence_id=0,
            sequence_start=False,
            sequence_end=False,
            priority=0,
            timeout=None,
            parameters=None,
        )
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        requests = _OneRequest(request)
        result = StreamResult(sent_ns=time.time_ns())
        call = next(self.stubs).ModelStreamInfer(iter(requests), timeout=timeout)
        try:
            for response in call:
                before = len(result.chunk_ns)
                if _collect(response, result, time.time_ns()):
                    break
                if on_chunk is not None and len(result.chunk_ns) > before:
                    on_chunk(result)
            else:
                result.error = "the stream ended before the final response"
            requests.finished.set()  # half-close: the server then ends the call
            for _ in call:
                pass
        except grpc.RpcError as error:
            if not result.done_ns:
                result.error = f"{error.code().name}: {error.details()}"
        finally:
            result.done_ns = result.done_ns or time.time_ns()
            requests.finished.set()
            call.cancel()  # a no-op on a call that has ended
        return result


def _collect(response, result: StreamResult, now_ns: int) -> bool:
    """Adds one ModelStreamInferResponse to `result`; True once the request is over."""
    if response.error_message:
        result.error = response.error_message
        result.done_ns = now_ns
        return True
    infer = InferResult(response.infer_response)
    text = infer.as_numpy("text_output")
    for name in METRIC_OUTPUTS:
        value = infer.as_numpy(name)
        if value is not None:
            result.metrics[name] = value.reshape(-1)[0].item()
    if text is not None:
        chunk = text.reshape(-1)[0].decode("utf-8")
        if chunk:
            result.text += chunk
            result.chunk_ns.append(now_ns)
            result.chunk_tokens.append(result.num_output_tokens)
    final = response.infer_response.parameters.get("triton_final_response")
    if final is not None and final.bool_param:
        result.done_ns = now_ns
        return True
    return False


def is_overload(message: str) -> bool:
    """A refusal for load (queue full, server stopping), not a failure of the request."""
    return any(m in message for m in ("queue full", "shutting down", "UNAVAILABLE"))
