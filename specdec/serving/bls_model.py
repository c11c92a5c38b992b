"""Glue of speculative_decoding: the decoupled BLS model that runs the batching loop.

execute() only validates and enqueues; one loop thread owns the scheduler, calls the engine
models (non-decoupled, one call each per iteration) and sends every response. Each request
ends with exactly one FINAL response on every path: success, bad input, engine error,
cancellation, shutdown.
"""

from __future__ import annotations

import json
import threading
from dataclasses import fields

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.engine import EngineBatch, EngineResult
from specdec.request import PROPOSERS, InvalidInput, parse_request
from specdec.scheduler import QueueFull, SchedulerConfig, Sequence, SpeculativeScheduler, Update
from specdec.serving.common import input_names, model_parameters, read_inputs, resolve_path
from specdec.serving.metrics import LoopMetrics
from specdec.tokenizer import load_tokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ENGINE_OUTPUTS = [f.name for f in fields(EngineResult)]


class TritonEngines:
    """The scheduler's two engine calls, as BLS requests to the engine models."""

    def __init__(self, draft_model: str, target_model: str) -> None:
        self.draft_model = draft_model
        self.target_model = target_model

    def _call(self, model: str, batch: EngineBatch) -> EngineResult:
        arrays = batch.to_arrays()
        tensors = [pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in arrays.items()]
        response = pb_utils.InferenceRequest(
            model_name=model,
            inputs=tensors,
            requested_output_names=ENGINE_OUTPUTS,
        ).exec()
        if response.has_error():
            raise RuntimeError(f"{model}: {response.error().message()}")
        return EngineResult.from_arrays(
            {
                name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()
                for name in ENGINE_OUTPUTS
            }
        )

    def draft(self, batch: EngineBatch) -> EngineResult:
        return self._call(self.draft_model, batch)

    def target(self, batch: EngineBatch) -> EngineResult:
        return self._call(self.target_model, batch)


def parse_default_k(value: str) -> int | None:
    """The default_num_draft_tokens parameter: "adaptive" or a fixed k."""
    return None if value.strip().lower() == "adaptive" else int(value)


def parse_proposers(value: str) -> tuple[str, ...]:
    """The proposers parameter: comma-separated names from PROPOSERS ("" = no speculation)."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in PROPOSERS]
    if unknown:
        raise ValueError(f"proposers: unknown {unknown}; expected names from {PROPOSERS}")
    return names


def _tensor(name: str, value, dtype) -> pb_utils.Tensor:
    return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))  # (1, 1): batch of one


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise ValueError("speculative_decoding must use the decoupled transaction policy")
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(resolve_path(params["checkpoint"]))
        self.config = SchedulerConfig(
            num_slots=int(params["num_slots"]),
            max_context=int(params["max_context"]),
            max_draft_tokens=int(params["max_num_draft_tokens"]),
            default_draft_tokens=parse_default_k(params["default_num_draft_tokens"]),
            max_queue=int(params.get("max_queue", 1024)),
            proposers=parse_proposers(params.get("proposers", ",".join(PROPOSERS))),
        )
        engines = TritonEngines(params["draft_model_name"], params["target_model_name"])
        self.scheduler = SpeculativeScheduler(engines, self.config, self.tokenizer.decode)
        self.inputs = input_names(args)
        self.metrics = LoopMetrics(
            args["model_name"], self.config.max_draft_tokens, self.config.num_slots
        )
        # Sequence id -> (request, response sender); guarded by self.lock with the scheduler.
        self.clients: dict[int, tuple[object, object]] = {}
        self.lock = threading.Condition()
        self.stopping = False
        self.loop_thread = threading.Thread(target=self._loop, name="speculative-loop", daemon=True)
        self.loop_thread.start()

    # -- requests in ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                generation = parse_request(
                    read_inputs(request, self.inputs),
                    tokenize=self.tokenizer.encode,
                    max_context=self.config.max_context,
                    max_draft_tokens=self.config.max_draft_tokens,
                    default_end_id=self.tokenizer.eos_token_id,
                    proposers=self.config.proposers,
                )
                with self.lock:
                    if self.stopping:
                        raise QueueFull("server is shutting down")
                    sequence = self.scheduler.submit(generation)
                    self.clients[sequence.id] = (request, sender)
                    self.lock.notify()
            except InvalidInput as error:
                self.metrics.finished("invalid")
                self._send_error(sender, str(error), pb_utils.TritonError.INVALID_ARG)
            except QueueFull as error:
                self.metrics.finished("rejected")
                self._send_error(sender, str(error), pb_utils.TritonError.UNAVAILABLE)
            except Exception as error:
                self.metrics.finished("error")
                self._send_error(sender, f"speculative_decoding: {error}")
        return None

    @staticmethod
    def _send_error(sender, message: str, code=None) -> None:
        code = pb_utils.TritonError.INTERNAL if code is None else code
        sender.send(
            pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL
        )

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.scheduler.has_work:
                    self.lock.wait()
                if self.stopping:
                    return
                self._mark_cancelled()
            try:
                updates = self.scheduler.step()
            except Exception as error:  # an engine failed: end every request, keep serving
                with self.lock:
                    for sequence in self.scheduler.fail_all():
                        self._end(sequence, f"speculative_decoding: {error}")
                        self.metrics.finished("error")
                    self.metrics.update_occupancy(0, 0, len(self.scheduler.free_slots))
                continue
            with self.lock:
                # Metrics first: a client that scrapes right after its final response sees
                # its request counted and its slot free.
                for update in updates:
                    if update.finished:
                        self.metrics.finished(update.sequence.finish_reason)
                if self.scheduler.last_iteration is not None:
                    self.metrics.record_iteration(self.scheduler.last_iteration)
                self.metrics.update_occupancy(
                    len(self.scheduler.running),
                    len(self.scheduler.waiting),
                    len(self.scheduler.free_slots),
                )
                for update in updates:
                    self._respond(update)

    def _mark_cancelled(self) -> None:
        """Once per iteration (it crosses a process boundary): drop cancelled streams."""
        for sequence in list(self.scheduler.running) + list(self.scheduler.waiting):
            request, _ = self.clients[sequence.id]
            if request.is_cancelled():
                self.scheduler.cancel(sequence)
                self._end(sequence, "request cancelled", pb_utils.TritonError.CANCELLED)
                self.metrics.finished("cancelled")

    def _end(self, sequence: Sequence, message: str, code=None) -> None:
        client = self.clients.pop(sequence.id, None)
        if client is not None:
            self._send_error(client[1], message, code)

    def _respond(self, update: Update) -> None:
        sequence = update.sequence
        request = sequence.request
        if not update.finished and not update.text:
            return  # nothing new to say this iteration
        prefix = ""
        if not request.stream and not request.exclude_input_in_output:
            prefix = request.prompt or ""
        # The ensemble's text too: a step after this one would be refused once the server
        # stops, and Triton 2.51's ensemble then never ends the stream (ensemble config).
        text = prefix + update.text
        tensors = [_tensor("text_output", text.encode("utf-8"), np.object_)]
        if update.finished:
            tensors += self._final_tensors(sequence)
        client = self.clients[sequence.id]
        if update.finished:
            del self.clients[sequence.id]
        client[1].send(
            pb_utils.InferenceResponse(output_tensors=tensors),
            flags=FINAL if update.finished else 0,
        )

    @staticmethod
    def _final_tensors(sequence: Sequence) -> list:
        request, stats = sequence.request, sequence.stats
        tensors = []
        if request.return_perf_metrics:
            tensors += [
                _tensor("acceptance_rate", stats.acceptance_rate, np.float32),
                _tensor("total_accepted_draft_tokens", stats.num_accepted_draft_tokens, np.int32),
                _tensor("total_draft_tokens", stats.num_draft_tokens, np.int32),
            ]
        if request.return_num_input_tokens:
            tensors.append(_tensor("num_input_tokens", len(request.prompt_ids), np.int32))
        if request.return_num_output_tokens:
            tensors.append(_tensor("num_output_tokens", sequence.num_output_tokens, np.int32))
        return tensors

    def finalize(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.loop_thread.join(timeout=60)
        with self.lock:
            for sequence in self.scheduler.fail_all("shutdown"):
                self._end(sequence, "server is shutting down", pb_utils.TritonError.UNAVAILABLE)
                self.metrics.finished("shutdown")
