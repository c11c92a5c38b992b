"""Glue of speculative_decoding: the decoupled BLS model that runs the batching loop.

execute() only validates and enqueues; one loop thread owns the scheduler, calls the engine
models (non-decoupled, one call each per iteration) and builds every response; the outbox
sends them after the iteration's metric updates, in order: at once, or with
`response_thread` on a thread of its own while the loop runs the next step
(specdec/serving/outbox.py; auto: with 4 or more usable cores). A streamed sequence answers
once its request's stream_interval output tokens have gathered (its first text and its final
response at once; specdec/serving/responses.py). A request of several prompts, or of
num_return_sequences > 1, runs one sequence per prompt and sequence; their responses share
the request's sender (tagged with batch_index and sequence_index). Each request ends with
exactly one FINAL response on every path: success, bad input, engine error, cancellation,
shutdown.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.engines.calls import LocalEngines, on_a_passing_thread
from specdec.engines.grammar import Grammars
from specdec.engines.select import create_engine
from specdec.engines.wire import decode_call, encode_result
from specdec.loop.admission import QueueFull
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import LoopSnapshot, SpeculativeScheduler
from specdec.loop.sequence import SequenceState, Update
from specdec.loop.timing import StepTimer
from specdec.serving import settings
from specdec.serving.cancel_ring import CancelRing, RunningTurns
from specdec.serving.common import input_names, model_parameters, read_inputs, resolve_path
from specdec.serving.metric_names import request_outcome
from specdec.serving.metrics import LoopMetrics
from specdec.serving.outbox import Outbox, Work
from specdec.serving.responses import StreamHold, response_arrays
from specdec.serving.settings import DRAIN_VARIABLE, decide_response_thread, usable_cores
from specdec.text.request import Guide, InvalidInput, parse_requests
from specdec.text.tokenizer import load_tokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Waiting and running requests asked per iteration, each round robin, whether their streams
# were cancelled (_mark_cancelled): bounded, so asking costs the same however long the queue
# and however large the batch.
WAITING_CANCEL_CHECKS = 16
RUNNING_CANCEL_CHECKS = 16
# How long the start-up cost measurement waits for Triton to be ready, and how often it
# asks meanwhile.
SERVER_WAIT_S = 600.0
SERVER_POLL_S = 0.2
# Once the server stops being ready (SIGTERM: Triton waits up to its exit timeout, 30 s in the
# container, for requests in flight, then exits without unloading), running requests get this
# long to finish (the launcher's servers: SPECDEC_DRAIN_S, shorter); the rest end with "server
# is shutting down" before Triton gives up on them. How often the health is asked meanwhile:
DRAIN_S = 20.0
HEALTH_POLL_S = 1.0


def health_url() -> str:
    """Triton's HTTP readiness, on SPECDEC_HTTP_PORT (set by specdec/server_config.py)."""
    return f"http://127.0.0.1:{os.environ.get('SPECDEC_HTTP_PORT', '8000')}/v2/health/ready"


def server_ready(url: str) -> bool:
    """Triton's HTTP health says every model is loaded."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:  # HTTPError (503: not ready) is an OSError too
        return False


def create_engines(params: dict[str, str]) -> LocalEngines:
    """The draft and the target engine, in this process, from the model's settings: one
    process, one CUDA context, and no Triton round trip per engine call."""
    kind, device = settings.ENGINE.read(params), settings.DEVICE.read(params)
    dtype, cuda_graphs = settings.DTYPE.read(params), settings.CUDA_GRAPHS.read(params)
    num_slots, max_length = settings.NUM_SLOTS.read(params), settings.MAX_CONTEXT.read(params)
    engines = []
    for checkpoint, engine_dir in (
        (settings.DRAFT_CHECKPOINT, settings.DRAFT_ENGINE_DIR),
        (settings.TARGET_CHECKPOINT, settings.TARGET_ENGINE_DIR),
    ):
        folder = engine_dir.read(params)
        engines.append(
            create_engine(
                kind,
                resolve_path(checkpoint.read(params)),
                num_slots=num_slots,
                max_length=max_length,
                device=device,
                engine_dir=resolve_path(folder) if folder else None,
                dtype=dtype,
                cuda_graphs=cuda_graphs,
            )
        )
    target_path = resolve_path(settings.TARGET_CHECKPOINT.read(params))
    grammars = Grammars.for_tokenizer(
        str(target_path),
        engines[1].config.vocab_size,
        json_whitespace=settings.GUIDED_JSON_WHITESPACE.read(params),
    )
    return LocalEngines(engines[0], engines[1], grammars)


class TritonRequest(Protocol):
    """What the loop asks of a pb_utils.InferenceRequest once it is queued."""

    def is_cancelled(self) -> bool: ...


class ResponseSender(Protocol):
    """A request's pb_utils response sender."""

    def send(self, response: object = None, flags: int = 0) -> None: ...


@dataclass
class OpenRequest:
    """A client request the BLS has taken and not yet ended: its sender, and the sequences
    that answer on it."""

    request: TritonRequest
    sender: ResponseSender
    requested: set[str] | None  # output names the client asked for
    num_open: int  # sequences not yet finished: the last one's response is FINAL
    sequences: list[SequenceState] = field(default_factory=list)
    sent_log_probs: dict[int, int] = field(default_factory=dict)  # sequence id -> count sent
    hold: StreamHold = field(default_factory=StreamHold)  # streamed text not sent yet
    ended: bool = False
    keys: list[str] = field(default_factory=list)  # request_key: a stop_request_key ends it

    @property
    def waiting(self) -> bool:
        """Not ended, and some sequence still waits for a slot."""
        return not self.ended and any(s.slot < 0 and not s.finished for s in self.sequences)


def _keys(array: np.ndarray) -> list[str]:
    """A request_key or stop_request_key: its strings."""
    return [v.decode("utf-8", "replace") for v in np.asarray(array).reshape(-1) if v]


def requested_outputs(request) -> set[str] | None:
    try:
        return set(request.requested_output_names())
    except AttributeError:  # an older python backend: build them all
        return None


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise ValueError("speculative_decoding must use the decoupled transaction policy")
        params = model_parameters(args)
        # Settings first (specdec/serving/settings.py; a missing one is its default): a bad
        # one stops the load at once, naming the setting.
        self.stream_interval = settings.STREAM_INTERVAL.read(params)
        threaded, why = decide_response_thread(
            settings.RESPONSE_THREAD.read(params), usable_cores()
        )
        self.calibration_seconds = settings.CALIBRATION_SECONDS.read(params)
        prefix_min_tokens = settings.PREFIX_MIN_TOKENS.read(params)  # checked even when off
        self.config = SchedulerConfig(
            num_slots=settings.NUM_SLOTS.read(params),
            max_context=settings.MAX_CONTEXT.read(params),
            max_draft_tokens=int(params["max_num_draft_tokens"]),
            default_draft_tokens=settings.DEFAULT_NUM_DRAFT_TOKENS.read(params),
            max_queue=settings.MAX_QUEUE.read(params),
            proposer_names=settings.PROPOSERS.read(params),
            ngram_match_lengths=settings.NGRAM_MATCH_LENGTHS.read(params),
            suffix_store_bytes=settings.SUFFIX_STORE_BYTES.read(params),
            prefix_min_tokens=prefix_min_tokens if settings.PREFIX_CACHE.read(params) else None,
            prefill_chunk=settings.PREFILL_CHUNK.read(params),
        )
        self.tokenizer = load_tokenizer(resolve_path(settings.TARGET_CHECKPOINT.read(params)))
        self.engines = on_a_passing_thread(lambda: create_engines(params))
        self.scheduler = SpeculativeScheduler(self.engines, self.config, self.tokenizer.decode)
        self.timer = StepTimer(self.scheduler)  # books each step's whole cost
        self.max_return_sequences = self.config.num_slots  # more would never run at once
        self.inputs = input_names(args)
        self.vocab_size = self.engines.target_engine.config.vocab_size
        self.metrics = LoopMetrics(
            args["model_name"], self.config.max_draft_tokens, self.config.num_slots
        )
        # Sequence id -> its request's OpenRequest; guarded by self.lock with the scheduler.
        self.open_requests: dict[int, OpenRequest] = {}
        self.lock = threading.Condition()
        self.stopping = False
        self.drain_deadline: float | None = None  # set once the server is stopping
        # Waiting requests, in the order their turn comes to be asked about cancellation
        # (_mark_cancelled); guarded by self.lock.
        self.cancel_ring = CancelRing[OpenRequest](lambda open_request: open_request.waiting)
        # Open requests by each of their request_keys, and those a stop_request_key named, for
        # the loop to end at its next iteration; guarded by self.lock.
        self.keyed: dict[str, list[OpenRequest]] = {}
        self.stopped: list[OpenRequest] = []
        # Running requests, likewise (a request joins when first seen running).
        self.running_turns = RunningTurns[OpenRequest](lambda open_request: not open_request.ended)
        # What the loop has to send since its last hand-over to the outbox (loop thread).
        self.work: list[Work] = []
        pb_utils.Logger.log_info(
            f"speculative_decoding: {why}; stream_interval {self.stream_interval}"
        )
        self.outbox = Outbox(
            on_error=self._log_outbox_error, threaded=threaded, name="speculative-outbox"
        )
        self.loop_thread = threading.Thread(target=self._loop, name="speculative-loop", daemon=True)
        self.loop_thread.start()
        self.health_thread = threading.Thread(
            target=self._watch_health, name="speculative-health", daemon=True
        )
        self.health_thread.start()

    def _calibrate(self) -> None:
        """Measures the engines' costs (the scheduler's calibrate) on the loop's thread before
        it serves. Triton refuses BLS calls in initialize, and its server crashed (signal 11,
        2.51) on BLS calls made while other models were still loading, so this waits until
        the server is ready: its HTTP health on SPECDEC_HTTP_PORT (set by
        specdec/server_config.py; 8000 otherwise) says so, or a request has come in. Requests
        that arrive meanwhile wait. If neither happens within SERVER_WAIT_S, or a call fails,
        the loop serves unmeasured (its curves then learn online). specdec_calibrated turns 1
        when this is over."""
        budget = self.calibration_seconds
        if budget <= 0:
            pb_utils.Logger.log_info("speculative_decoding: start-up cost measurement off")
        elif not self._wait_for_server():
            pb_utils.Logger.log_warn(
                "speculative_decoding: no start-up cost measurement: the server did not "
                f"report ready within {SERVER_WAIT_S:.0f} s"
            )
        else:
            try:
                calibration = self.scheduler.calibrate(budget)
                pb_utils.Logger.log_info(f"speculative_decoding: {calibration.summary()}")
            except Exception as error:
                pb_utils.Logger.log_warn(
                    f"speculative_decoding: no start-up cost measurement: {error}"
                )
        self.metrics.calibrated.set(1)

    def _watch_health(self) -> None:
        """The engines live in this process, so nothing here fails when the server starts
        stopping: once its health, ready before, turns not ready, the loop drains (DRAIN_S,
        or SPECDEC_DRAIN_S)."""
        url, was_ready = health_url(), False
        drain_s = float(os.environ.get(DRAIN_VARIABLE, DRAIN_S))
        while not self.stopping:
            time.sleep(HEALTH_POLL_S)
            ready = server_ready(url)
            if was_ready and not ready:
                with self.lock:
                    self.drain_deadline = time.monotonic() + drain_s
                    self.lock.notify()
                pb_utils.Logger.log_info(
                    f"speculative_decoding: the server is stopping; {drain_s:g} s to finish"
                )
                return
            was_ready = was_ready or ready

    def _drained(self) -> bool:
        """Past the drain deadline: ends every sequence left (under self.lock)."""
        if self.drain_deadline is None or time.monotonic() < self.drain_deadline:
            return False
        for sequence in self.scheduler.fail_all("shutdown"):
            code = pb_utils.TritonError.UNAVAILABLE
            self._end(sequence, "shutdown", "server is shutting down", code)
        self._record_state(self.scheduler.snapshot())
        return True

    def _wait_for_server(self) -> bool:
        url = health_url()
        deadline = time.monotonic() + SERVER_WAIT_S
        while not self.stopping and time.monotonic() < deadline:
            if self.scheduler.has_work or server_ready(url):  # a request: it is ready
                return True
            time.sleep(SERVER_POLL_S)
        return False

    # -- requests in ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            call = pb_utils.get_input_tensor_by_name(request, "engine_call")
            if call is not None:
                self._engine_call(call.as_numpy().reshape(-1)[0], sender)
                continue
            inputs = read_inputs(request, self.inputs)
            if "stop_request_key" in inputs:
                self._stop(_keys(inputs.pop("stop_request_key")), sender)
                continue
            keys = _keys(inputs.pop("request_key", np.zeros(0, np.object_)))
            try:
                generations = parse_requests(
                    inputs,
                    tokenize=self.tokenizer.encode,
                    max_context=self.config.max_context,
                    max_draft_tokens=self.config.max_draft_tokens,
                    default_end_id=self.tokenizer.eos_token_id,
                    proposers=self.config.proposer_names,
                    max_return_sequences=self.max_return_sequences,
                    default_stream_interval=self.stream_interval,
                    vocab_size=self.vocab_size,
                    check_guide=self._check_guide,
                )
                with self.lock:
                    if self.stopping or self.drain_deadline is not None:
                        raise QueueFull("server is shutting down")
                    sequences = self.scheduler.submit_all(generations)
                    open_request = OpenRequest(
                        request, sender, requested_outputs(request), len(sequences)
                    )
                    open_request.sequences = sequences
                    for sequence in sequences:
                        self.open_requests[sequence.id] = open_request
                    open_request.keys = keys
                    for key in keys:
                        self.keyed.setdefault(key, []).append(open_request)
                    self.cancel_ring.add(open_request)
                    self.lock.notify()
            except InvalidInput as error:
                self._refuse(sender, "invalid", str(error), pb_utils.TritonError.INVALID_ARG)
            except QueueFull as error:
                self._refuse(sender, "rejected", str(error), pb_utils.TritonError.UNAVAILABLE)
            except Exception as error:
                self._refuse(sender, "error", f"speculative_decoding: {error}")
        return None

    def _stop(self, keys: list[str], sender) -> None:
        """Ends the open requests with any of these request_keys at the loop's next
        iteration, as cancelled ones; answers at once: an empty response, or NOT_FOUND where
        none is open under them."""
        with self.lock:
            found = [r for key in keys for r in self.keyed.get(key, ())]
            self.stopped += found
            self.lock.notify()
        if not found:
            message = f"stop_request_key: no open request has key {', '.join(keys)!r}"
            code = pb_utils.TritonError.NOT_FOUND
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        else:
            response = pb_utils.InferenceResponse(output_tensors=[])
        sender.send(response, flags=FINAL)

    def _engine_call(self, data: bytes, sender) -> None:
        """One engine call from outside the loop (draft_model, target_model: a call of its
        own on the shared engines, between the loop's calls), answered at once."""
        try:
            role, batch = decode_call(data)
            result = on_a_passing_thread(lambda: self.engines.call(role, batch))
            encoded = np.array([[encode_result(result)]], dtype=np.object_)
            response = pb_utils.InferenceResponse([pb_utils.Tensor("engine_result", encoded)])
        except ValueError as error:
            message = f"speculative_decoding: {error}"
            code = pb_utils.TritonError.INVALID_ARG
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        except Exception as error:
            message = f"speculative_decoding: engine call: {error}"
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        sender.send(response, flags=FINAL)

    def _refuse(self, sender, outcome: str, message: str, code=None) -> None:
        """Ends a request that never reached the loop (no sequence ran); through the outbox,
        counted first."""
        self.metrics.request_ended(outcome)
        self.outbox.submit([self.metrics.flush, self._error_sender(sender, message, code)])

    @staticmethod
    def _error_sender(sender, message: str, code=None) -> Work:
        code = pb_utils.TritonError.INTERNAL if code is None else code
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        return functools.partial(sender.send, response, flags=FINAL)

    @staticmethod
    def _log_outbox_error(error: BaseException) -> None:
        pb_utils.Logger.log_warn(f"speculative_decoding: sending a response failed: {error}")

    def _hand_over(self) -> None:
        """Gives the outbox the loop's metric updates and responses so far (loop thread,
        without self.lock: the outbox may make it wait for a free place)."""
        self.metrics.record_outbox_seconds(self.outbox.busy_seconds)
        self.metrics.stage_histograms()
        work, self.work = self.work, []
        self.outbox.submit([self.metrics.flush, *work])

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        self._calibrate()
        clock = time.perf_counter
        while True:
            with self.lock:
                while not self.stopping and not self.scheduler.has_work:
                    self.lock.wait()
                if self.stopping:
                    return
                drained = self._drained()
                started = clock()
                if not drained:
                    self._mark_cancelled(self.scheduler.snapshot())
            if drained:
                self._hand_over()
                continue
            if self.work:  # cancelled streams hear so now, not after the step
                self._hand_over()
            checked = clock()
            try:
                result = self.timer.step()
            except Exception as error:  # an engine failed: end every request, keep serving
                with self.lock:
                    failed = self.scheduler.fail_all()
                    for sequence in failed:
                        self._end(sequence, "error", f"speculative_decoding: {error}")
                    self._record_state(self.scheduler.snapshot())
                self._hand_over()
                continue
            stepped = clock()
            with self.lock:
                # Metrics go out before the responses (the outbox flushes them first): a
                # client that scrapes right after its final response sees its request and
                # sequences counted (_respond) and its slot free.
                if result.stats is not None:
                    self.metrics.record_iteration(result.stats)
                self._record_state(result.snapshot)
                now_ns = time.time_ns()  # the sequences' clock (SequenceTimes)
                for update in result.updates:
                    self._respond(update, now_ns)
            # This iteration's times go out with its responses: recorded after the hand-over,
            # a long prefill iteration's seconds reached the counters only with the next
            # iteration's, after its streams' first tokens (the bench then counted them in
            # the window that followed). The hand-over's own time follows one pass later.
            built = clock()
            self.metrics.record_loop_seconds(
                cancel_check=checked - started,
                step=stepped - checked,
                respond=built - stepped,
                iteration=result.stats,
            )
            self._hand_over()
            self.metrics.record_hand_over_seconds(clock() - built)
            if not self.scheduler.has_work:  # before the loop sleeps: counters up to date
                self._hand_over()

    def _record_state(self, snapshot: LoopSnapshot) -> None:
        self.metrics.update_occupancy(
            len(snapshot.running), snapshot.num_waiting, snapshot.num_free_slots
        )
        self.metrics.record_prefix_counts(snapshot.prefix_counts, snapshot.num_cached_prefixes)
        if snapshot.suffix_store is not None:
            self.metrics.record_suffix_store(snapshot.suffix_store)

    def _mark_cancelled(self, snapshot: LoopSnapshot) -> None:
        """Drops cancelled streams, every sequence of the request. is_cancelled() crosses a
        process boundary (asking every waiting and running request each iteration cost more
        than the step's own work under load: docs/operations.md, Robustness, Cancellation),
        so it is asked once per request, of at most num_slots + RUNNING_CANCEL_CHECKS +
        WAITING_CANCEL_CHECKS requests per iteration however long the queue and however
        large the batch: those about to get a free slot (where the
        answer changes this iteration's work), the next RUNNING_CANCEL_CHECKS running ones
        and the next WAITING_CANCEL_CHECKS waiting ones, each round robin
        (serving/cancel_ring.py).

        Delay bound: with R requests running, each is asked at least once every
        ceil(R / RUNNING_CANCEL_CHECKS) iterations (64 rows: 4 iterations; up to 16 rows:
        every iteration); with Q waiting, each at least once every
        ceil(Q / WAITING_CANCEL_CHECKS) iterations (1,024 waiting: 64), and at every
        iteration once it is about to get a slot, so a cancelled request never starts."""
        stopped, self.stopped = self.stopped, []
        for stopped_request in stopped:
            self._cancel_request(stopped_request, "request stopped")
        candidates = [self.open_requests.get(s.id) for s in snapshot.next_admitted]
        self.running_turns.see(
            open_request
            for open_request in (self.open_requests.get(s.id) for s in snapshot.running)
            if open_request is not None
        )
        candidates += self.running_turns.take(RUNNING_CANCEL_CHECKS)
        candidates += self.cancel_ring.take(WAITING_CANCEL_CHECKS)
        checked = set()
        for open_request in candidates:
            if open_request is None or open_request.ended or id(open_request) in checked:
                continue
            checked.add(id(open_request))
            if open_request.request.is_cancelled():
                self._cancel_request(open_request, "request cancelled")

    def _cancel_request(self, open_request: OpenRequest, message: str) -> None:
        """Drops every sequence of the request and ends it with CANCELLED (under self.lock)."""
        if open_request.ended:
            return
        for member in open_request.sequences:
            if member.id in self.open_requests:
                self.scheduler.cancel(member)
        self._end_request(open_request, "cancelled", message, pb_utils.TritonError.CANCELLED)

    def _end(self, sequence: SequenceState, outcome: str, message: str, code=None) -> None:
        """Ends the sequence's request with an error (once), and with it its other sequences."""
        open_request = self.open_requests.get(sequence.id)
        if open_request is not None:
            self._end_request(open_request, outcome, message, code)

    def _end_request(
        self, open_request: OpenRequest, outcome: str, message: str, code=None
    ) -> None:
        """Ends a request with an error (once), every sequence of it; counts the request and
        its sequences still open under `outcome` (those that finished were counted then)."""
        if open_request.ended:
            return
        self._close(open_request)
        self.metrics.request_ended(outcome)
        self.metrics.sequences_ended(outcome, open_request.num_open)
        for member in open_request.sequences:
            self.open_requests.pop(member.id, None)
        self.work.append(self._error_sender(open_request.sender, message, code))

    def _close(self, open_request: OpenRequest) -> None:
        """The request has sent or is sending its final response (under self.lock)."""
        open_request.ended = True
        for key in open_request.keys:
            others = [r for r in self.keyed.pop(key, ()) if r is not open_request]
            if others:
                self.keyed[key] = others

    def _check_guide(self, guide: Guide) -> None:
        """Compiles a request's guide (cached), or raises ValueError saying why not."""
        if self.engines.grammars is None:
            raise ValueError("guided decoding is not available on this server")
        self.engines.grammars.compile(guide.pair)

    def _respond(self, update: Update, now_ns: int) -> None:
        """One sequence's update: its response, if one is due, and its metrics (`now_ns`:
        when this iteration's responses are built)."""
        sequence = update.sequence
        open_request = self.open_requests.get(sequence.id)
        if open_request is None:
            return  # ended already
        if sequence.error:  # the loop ended it (specdec/loop/sequence.py: no_token_error)
            self._end(sequence, "error", sequence.error, pb_utils.TritonError.INVALID_ARG)
            return
        self.metrics.tokens_committed(sequence, update.num_emitted)
        text: str | None = update.text
        request = sequence.request
        if request.stream and request.stream_interval > 1:
            text = open_request.hold.take(
                sequence.id,
                update.text,
                sequence.num_output_tokens,
                request.stream_interval,
                update.finished,
            )
        elif not update.finished and not text:
            text = None
        if text is None:
            return  # nothing to say this iteration: no response built
        # The ensemble's text too: a step after this one would be refused once the server
        # stops, and Triton 2.51's ensemble then never ends the stream (ensemble config).
        arrays = response_arrays(
            sequence, text, open_request.sent_log_probs.get(sequence.id, 0), open_request.requested
        )
        open_request.sent_log_probs[sequence.id] = len(sequence.output_log_probs)
        flags = 0
        if update.finished:
            del self.open_requests[sequence.id]
            open_request.num_open -= 1
            assert sequence.finish_reason is not None  # update.finished
            self.metrics.sequences_ended(sequence.finish_reason)
            self.metrics.sequence_finished(sequence, now_ns)
            if open_request.num_open == 0:
                self._close(open_request)
                flags = FINAL
                reasons = (member.finish_reason for member in open_request.sequences)
                self.metrics.request_ended(request_outcome(reasons))
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        self.work.append(functools.partial(open_request.sender.send, response, flags=flags))

    def finalize(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.loop_thread.join(timeout=60)
        with self.lock:
            ended = self.scheduler.fail_all("shutdown")
            for sequence in ended:
                self._end(
                    sequence,
                    "shutdown",
                    "server is shutting down",
                    pb_utils.TritonError.UNAVAILABLE,
                )
        self._hand_over()
        self.outbox.close(timeout=60)
