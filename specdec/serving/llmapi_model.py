"""Glue of tensorrt_llm: TensorRT-LLM's LLM-API schema (specdec/text/llmapi.py) as another
entry point of the speculate-verify loop in speculative_decoding.

Not decoupled, as TensorRT-LLM's model.yaml has it: execute() answers each request once.
It forwards the request to speculative_decoding (a decoupled BLS call: the loop batches it
with everything else) and waits for the loop's answer, so the model's instances
(config.pbtxt: each a process of its own) are how many requests it serves at once; Triton
2.51's python backend lets only decoupled models answer after execute() returns. A
decoupled copy (tensorrt_llm_stream) answers from a thread per request instead, never
holds a request back, and serves `streaming`: a response per loop response, each with the
whole text so far (the LLM API's streamed outputs).

Stop (TensorRT-LLM's `stop` input): each forwarded request carries keys (speculative_decoding's
request_key): one of its own, and its client's request id; a stop request ends the running
requests of its id through the BLS (stop_request_key), whichever instance or copy serves
them, and a client that cancels its call is stopped through its own key (polled every
CANCEL_POLL_S). A stopped request ends with CANCELLED; the stop request too, found or not,
as TensorRT-LLM answers it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.serving.common import input_names, model_parameters, read_inputs
from specdec.serving.responses import PERF_OUTPUTS
from specdec.text.llmapi import (
    LLMAPIRequest,
    answer_arrays,
    is_stop,
    llmapi_message,
    loop_error_kind,
    parse_llmapi,
)
from specdec.text.request import InvalidInput

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.2  # how often running requests are asked whether their client cancelled
FINALIZE_WAIT_S = 30.0
# Request keys in speculative_decoding: every copy of this model shares the id keys, so a
# stop reaches a request whichever instance serves it.
OWN_KEY, ID_KEY = "llmapi/", "llmapi-id/"
Send = Callable[[object, bool], None]  # (response, final)
# A loop error's kind (specdec/text/llmapi.py loop_error_kind) -> its pb_utils.TritonError
# code (read when used: pb_utils has no TritonError when Triton first imports this module).
ERROR_CODES = {
    "cancelled": "CANCELLED",
    "unavailable": "UNAVAILABLE",
    "invalid": "INVALID_ARG",
    "internal": "INTERNAL",
}


class Cancellable(Protocol):
    """A pb_utils.InferenceRequest, as the cancel watcher asks it."""

    def is_cancelled(self) -> bool: ...


class LoopError(Exception):
    """speculative_decoding refused or ended a request: its message and status code."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def _error_response(message: str, code: int | None = None):
    code = pb_utils.TritonError.INTERNAL if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _text(array: np.ndarray | None) -> str:
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _requested(request) -> set[str] | None:
    try:
        return set(request.requested_output_names()) or None
    except AttributeError:  # an older python backend: send them all
        return None


def _strings(values: list[str]) -> np.ndarray:
    return np.array([[v.encode("utf-8") for v in values]], dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.bls_model = model_parameters(args)["bls_model_name"]
        self.inputs = input_names(args)
        self.lock = threading.Lock()  # guards the two below
        self.running: dict[str, Cancellable] = {}  # own key -> its request (cancel polling)
        self.threads: set[threading.Thread] = set()  # decoupled: the requests in flight
        self.closing = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancelled, daemon=True)
        self.watcher.start()

    def execute(self, requests):
        if not self.decoupled:  # one answer each, in order
            answers: list[object] = []
            for request in requests:
                self._serve(request, read_inputs(request, self.inputs), self._keep(answers))
            return answers
        for request in requests:
            send = self._sender(request.get_response_sender())
            work = (request, read_inputs(request, self.inputs), send)
            thread = threading.Thread(target=self._serve, args=work, daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    @staticmethod
    def _keep(answers: list[object]) -> Send:
        def keep(response: object, final: bool) -> None:
            if final:
                answers.append(response)

        return keep

    @staticmethod
    def _sender(sender) -> Send:
        return lambda response, final: sender.send(response, flags=FINAL if final else 0)

    # -- one request ----------------------------------------------------------------------
    def _serve(self, request, inputs: dict[str, np.ndarray], send: Send) -> None:
        """Answers the request through `send`, its last response final, on every path."""
        try:
            if is_stop(inputs):
                send(self._stop_by_id(request.request_id()), True)
                return
            llm_request = parse_llmapi(inputs)
            if llm_request.streaming and not self.decoupled:
                raise InvalidInput(
                    "streaming",
                    "this model answers once (it is not decoupled): use tensorrt_llm_stream",
                )
            self._generate(request, llm_request, send)
        except InvalidInput as error:
            send(_error_response(str(error), pb_utils.TritonError.INVALID_ARG), True)
        except LoopError as error:
            send(_error_response(llmapi_message(str(error)), error.code), True)
        except Exception as error:
            send(_error_response(f"{self.bls_model}: {error}"), True)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _generate(self, request, llm_request: LLMAPIRequest, send: Send) -> None:
        own_key = OWN_KEY + uuid.uuid4().hex
        keys = [own_key]
        if request.request_id():
            keys.append(ID_KEY + request.request_id())
        requested = _requested(request)
        with self.lock:
            self.running[own_key] = request
        try:
            text, last = "", {}
            for arrays in self._loop_responses(llm_request, keys):
                text += _text(arrays.get("text_output"))
                last = arrays
                if llm_request.streaming and not _text(arrays.get("finish_reason")):
                    answer = answer_arrays(llm_request, text, last, final=False)
                    send(self._response(answer, requested), False)
            answer = answer_arrays(llm_request, text, last, final=True)
            send(self._response(answer, requested), True)
        finally:
            with self.lock:
                self.running.pop(own_key, None)

    def _loop_responses(self, llm_request: LLMAPIRequest, keys: list[str]):
        """The BLS's responses to the request, as arrays by name; raises LoopError on its
        error."""
        inputs = dict(llm_request.inputs)
        inputs["request_key"] = _strings(keys)
        inputs["stream"] = np.array([[llm_request.streaming]])
        outputs = ["text_output", "finish_reason"]
        if llm_request.wants_log_prob:
            outputs.append("cum_log_probs")
        if llm_request.wants_perf:
            outputs += PERF_OUTPUTS
        responses = pb_utils.InferenceRequest(
            model_name=self.bls_model,
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            requested_output_names=outputs,
        ).exec(decoupled=True)
        for response in responses:
            if response.has_error():
                error = response.error()
                kind = loop_error_kind(error.message(), self.bls_model)
                raise LoopError(error.message(), getattr(pb_utils.TritonError, ERROR_CODES[kind]))
            arrays = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if arrays:
                yield arrays

    @staticmethod
    def _response(arrays: dict[str, np.ndarray], requested: set[str] | None):
        tensors = [
            pb_utils.Tensor(name, array)
            for name, array in arrays.items()
            if requested is None or name in requested
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # -- stop ---------------------------------------------------------------------------
    def _stop_by_id(self, request_id: str | None):
        """The answer to a stop request: CANCELLED, saying whether it found one, as
        TensorRT-LLM answers it (found or not); INVALID_ARG without a request id."""
        if not request_id:
            message = "stop: needs the request id of the request to stop"
            return _error_response(message, pb_utils.TritonError.INVALID_ARG)
        if self._stop_key(ID_KEY + request_id):
            message = f"stop: stopped the running request(s) with id {request_id!r}"
        else:
            message = f"stop: no running request has id {request_id!r}"
        return _error_response(message, pb_utils.TritonError.CANCELLED)

    def _stop_key(self, key: str) -> bool:
        """Asks the BLS to end the request it holds under `key`; whether it held one."""
        tensor = pb_utils.Tensor("stop_request_key", _strings([key]))
        responses = pb_utils.InferenceRequest(
            model_name=self.bls_model, inputs=[tensor], requested_output_names=[]
        ).exec(decoupled=True)
        return all(not response.has_error() for response in responses)

    def _watch_cancelled(self) -> None:
        while not self.closing.wait(CANCEL_POLL_S):
            with self.lock:
                running = list(self.running.items())
            for key, request in running:
                try:
                    cancelled = request.is_cancelled()
                except Exception:  # it ended meanwhile
                    continue
                if cancelled:
                    with self.lock:
                        self.running.pop(key, None)  # asked once
                    try:
                        self._stop_key(key)
                    except Exception as error:  # the BLS is gone: nothing left to stop
                        pb_utils.Logger.log_warn(f"tensorrt_llm: stopping {key}: {error}")

    def finalize(self) -> None:
        """Waits a while for the requests in flight (the BLS ends them as it stops)."""
        self.closing.set()
        deadline = time.monotonic() + FINALIZE_WAIT_S
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
