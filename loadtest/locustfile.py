"""Locust load test: streamed generations over gRPC (tritonclient's protocol) or over the
OpenAI-compatible HTTP API (server-sent events).

    .venv/bin/locust -f loadtest/locustfile.py --headless --host 127.0.0.1:8001 \
        -u 64 -r 64 --run-time 2m --csv out
    .venv/bin/locust -f loadtest/locustfile.py OpenAIUser --headless \
        --host http://127.0.0.1:9000 -u 16 -r 16 --run-time 1m

`GrpcUser` (the default) streams from Triton's gRPC port; every user of a Locust process
shares a few gRPC channels (loadtest/grpc_streams.py: one channel per user starved gevent's
thread pool past ~10 users, and responses reached the users minutes late). `OpenAIUser`
streams /v1/chat/completions (or /v1/completions with --openai-completions) with Locust's
FastHttpUser. Users send the prompts of a workload (common.WORKLOAD_NAMES) one after another,
each picked at random: `--workload chat` (the default, loadtest/prompts.jsonl), `grounded`
(answers that copy or rework text given in the prompt), `rewrite` (answers that rework it
rather than copy it), `shared-prefix` (one system text of about 1,000 tokens, then a
question about it), `multi-turn` (a conversation of four user turns: each request resends
the history with the answers this user received; a user keeps its conversation across its
tasks and, after the last turn or a failed request, opens another at random), `agentic`
(loadtest/agentic.py: tool calls in a JSON format, conversations as multi-turn's; a user
opens task i for a random 63-bit i, so that no two conversations of a run are the same: with
a million conversations the odds of any repeat are about 1 in 20 million) or `structured`
(loadtest/structured.py: JSON extraction and tool calls, each request with the JSON schema
its answer must follow, sent as guided_decoding_guide_type / guided_decoding_guide, or over
the OpenAI API as response_format; max_tokens at least structured.MAX_TOKENS).
Per request they report, as Locust entries:
- `generate`: whole-request latency, response length = output tokens (a failure if the
  server answered with an error);
- `refused`: the server turned the request away for load (queue full, shutting down); a
  failure of its own row, with the server's message;
- `time_to_first_token` and `inter_chunk`: latencies in ms;
- `tokens_per_s`: the request's output tokens per second, in the response-time column
  (Locust only aggregates times: higher is better in that row);
- `structured_output` (structured): a guided answer, a success when valid under its schema,
  a failure "invalid under its schema" or "cut by max_tokens" (structured.check); the
  records say which as `validity`.
Times are taken when a response reaches the user's greenlet.

Which users, and in which mode (common.MODES: k0, adaptive, ...): `--plan file.json` (what
`make loadtest` writes: stages of users, each in windows that alternate the modes; a
request takes the mode of the window it leaves in; after the last window the users go on
until every request of the plan has finished); `--ramp` (1, 4, 16 ... --max-users users,
--stage-seconds each up to 16 users, longer beyond as schedule.window_seconds, the mode of
--num-draft-tokens); `--smoke` (1, 2, 4 users, 10 s each); none of them: Locust's -u, -r
and --run-time. `--records` appends one JSON line per request (window, mode, send and
arrival times, tokens per response, the server's times) for run_loadtest.py.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent
from gevent import monkey
from locust import FastHttpUser, LoadTestShape, User, between, events, task

grpc_gevent.init_gevent()  # before any gRPC channel exists

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODES, WORKLOAD_NAMES, Message, read_workload  # noqa: E402
from grpc_streams import StreamPool, StreamResult, is_overload  # noqa: E402
from schedule import STAGES, PlannedWindow, build_plan, window_at  # noqa: E402
from structured import Guide, check, guide_inputs  # noqa: E402
from walks import Workload, raw_text, shuffled  # noqa: E402

# ChatML as SmolLM2's template writes it, with its default system turn where the messages
# bring none (tests/test_prefix_workloads.py holds it to the tokenizer's template);
# --raw-prompts sends the messages' text without it (walks.raw_text), for a model with another
# template. OpenAIUser sends the messages themselves.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOKE_USERS = [1, 2, 4]
TAIL_SECONDS = 900.0  # --plan: the most the users go on after the last window
# Each mode's request inputs: common.MODES, and the kN that --num-draft-tokens makes up.
REQUEST_INPUTS: dict[str, dict] = dict(MODES)


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--num-draft-tokens", type=int, default=-1, help="-1: leave it to the server (adaptive)"
    )
    parser.add_argument("--model", default="ensemble", help="GrpcUser: the Triton model")
    parser.add_argument("--stream-timeout", type=float, default=900.0)
    parser.add_argument("--grpc-channels", type=int, default=4, help="per Locust process")
    parser.add_argument("--openai-completions", action="store_true", help="/v1/completions")
    parser.add_argument("--plan", default="", help="a plan of windows (run_loadtest.py)")
    parser.add_argument("--ramp", action="store_true", help="1, 4, 16 ... --max-users users")
    parser.add_argument("--smoke", action="store_true", help="1, 2, 4 users, 10 s each, for CI")
    parser.add_argument(
        "--stage-seconds", type=float, default=60.0, help="--ramp, to 16 users (x2 64, x3 128+)"
    )
    parser.add_argument("--max-users", type=int, default=512, help="--ramp: the last stage")
    parser.add_argument("--raw-prompts", action="store_true", help="no chat format")
    parser.add_argument(
        "--workload", default="chat", choices=sorted(WORKLOAD_NAMES), help="the prompts to send"
    )
    parser.add_argument("--records", default="", help="append one JSON line per request here")


EXIT_GRACE_SECONDS = 20.0


@events.quit.add_listener
def bound_the_exit(exit_code: int, **_kwargs) -> None:
    """Locust has written its stats; make sure the process then ends within a grace period.

    In CI, one headless run printed its summary and then never exited: interpreter shutdown
    blocked (gRPC's gevent mode is the likely party). A real OS thread, which gevent's monkey
    patching does not turn into a greenlet, waits out the grace period, dumps every thread's
    stack to stderr for the record, and ends the process with Locust's exit code. A normal
    exit never meets it."""
    start_real_thread = monkey.get_original("_thread", "start_new_thread")
    real_sleep = monkey.get_original("time", "sleep")

    def force_exit() -> None:
        real_sleep(EXIT_GRACE_SECONDS)
        print(
            f"locustfile: still exiting {EXIT_GRACE_SECONDS:.0f} s after Locust quit; "
            f"forcing exit code {exit_code}. Stacks:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(all_threads=True)
        sys.stdout.flush()
        os._exit(exit_code)

    start_real_thread(force_exit, ())


@functools.cache
def workload_of(name: str) -> Workload:
    """A --workload's requests or conversations (read once per process)."""
    return read_workload(name)


def chat_format(messages: list[Message]) -> str:
    """The messages as SmolLM2's chat template writes them, the answer's turn opened."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def mode_of(num_draft_tokens: int) -> str:
    """--num-draft-tokens as a mode name: -1 adaptive, 0 k0, else kN (made up if new)."""
    if num_draft_tokens < 0:
        return "adaptive"
    name = f"k{num_draft_tokens}"
    REQUEST_INPUTS.setdefault(
        name, {"num_draft_tokens": num_draft_tokens, "fixed_num_draft_tokens": num_draft_tokens > 0}
    )
    return name


def load_plan(options) -> list[PlannedWindow]:
    """The run's windows: --plan's file, or those --ramp / --smoke stand for."""
    if options.plan:
        windows = json.loads(Path(options.plan).read_text())["windows"]
        return [PlannedWindow(**w) for w in windows]
    mode = mode_of(options.num_draft_tokens)
    if options.smoke:  # each stage one window of 10 s, in two halves
        return build_plan(SMOKE_USERS, [mode], 5.0)
    stages = [u for u in STAGES if u <= options.max_users]
    return build_plan(stages, [mode], options.stage_seconds / 2)


class Tracker:
    """What the shape needs to know of the users' requests: how many requests of the plan's
    windows are still under way (after the last window the run waits for them)."""

    outstanding = 0


class PlanShape(LoadTestShape):
    """Users and mode by the plan (--plan, --ramp, --smoke): each window's users, spawned
    at once. After the last window the users go on in its mode (their requests not counted)
    until the plan's requests have finished, at most TAIL_SECONDS; then the run stops."""

    use_common_options = True
    plan: list[PlannedWindow] = []

    def tick(self):
        if not self.plan:
            PlanShape.plan = load_plan(self.runner.environment.parsed_options)
        run_time = self.get_run_time()
        window = window_at(self.plan, run_time)
        if window is not None:
            return window.users, window.users
        last = self.plan[-1]
        if Tracker.outstanding > 0 and run_time < last.end_s + TAIL_SECONDS:
            return last.users, last.users
        return None


if not any(flag in sys.argv for flag in ("--plan", "--ramp", "--smoke")):
    del PlanShape  # Locust uses any shape class it finds; without one, -u/-r/--run-time


class StreamingUser:
    """What both users share: the mode of the moment, the records, the Locust entries."""

    abstract = True
    wait_time = between(0.0, 0.2)

    def setup(self) -> None:
        self.options = self.environment.parsed_options
        self.rng = random.Random()
        # the user's requests: a walk of the workload, in random order, kept across its tasks
        workload = workload_of(self.options.workload)
        self.walk = workload.walk(lambda count: shuffled(self.rng, count))
        self.workload = workload
        # A workload whose prompts repeat (all but agentic) runs each mode under a cache_salt
        # of its own: the suffix store and the prefix cache then never hand one mode's
        # windows the answers another mode got to the same prompts.
        self.salted = not workload.unique
        self.current: tuple[dict, StreamResult] | None = None  # the request under way

    def next_request(self) -> dict:
        """The mode and window for a request leaving now, as a record to fill in."""
        shape = self.environment.shape_class
        window = None
        if shape is not None and getattr(shape, "plan", None):
            window = window_at(shape.plan, shape.get_run_time())
        if window is None and shape is not None and getattr(shape, "plan", None):
            mode, index = shape.plan[-1].mode, -1  # the tail: same mode, not counted
        elif window is None:
            mode, index = mode_of(self.options.num_draft_tokens), -1
        else:
            mode, index = window.mode, window.index
        if index >= 0:
            Tracker.outstanding += 1
        # users: the window's, as the plan sets them; running_users: those spawned when the
        # request left (the shape spawns a window's users up to a tick after it starts).
        running = self.environment.runner.user_count
        record = {
            "window": index,
            "mode": mode,
            "users": window.users if window is not None else running,
            "running_users": running,
        }
        # Until its first response: what a user stopped now leaves (no server times: the
        # accounting ignores it; the BLS drops it, an ensemble would still run it).
        self.current = (record, StreamResult(sent_ns=time.time_ns()))
        return record

    def params(self, mode: str) -> dict:
        o = self.options
        max_tokens = self.workload.max_tokens(o.max_tokens)  # structured: room for its answers
        params = dict(max_tokens=max_tokens, temperature=o.temperature, top_p=o.top_p)
        params.update(REQUEST_INPUTS[mode])
        if self.salted:
            params["cache_salt"] = f"locust-{mode}"
        if o.temperature > 0:
            params["seed"] = self.rng.randrange(2**32)
        return params

    def finish(
        self, record: dict, result: StreamResult, guide: Guide | None = None, max_tokens: int = 0
    ) -> None:
        """Locust entries and the record of one request (`guide`: its guided decoding, whose
        answer is checked; `max_tokens`: as sent)."""
        elapsed_ms = 1000 * result.elapsed
        if result.error is not None:
            refused = is_overload(result.error)
            record["outcome"] = "refused" if refused else "failed"
            record["error"] = result.error
            fire("refused" if refused else "generate", elapsed_ms, exception=result.error)
        else:
            record["outcome"] = "ok"
            tokens = result.num_output_tokens
            fire("generate", elapsed_ms, length=tokens)
            if result.time_to_first_token is not None:
                fire("time_to_first_token", 1000 * result.time_to_first_token)
            for before, after in zip(result.chunk_ns, result.chunk_ns[1:], strict=False):
                fire("inter_chunk", (after - before) / 1e6)
            if result.elapsed > 0:
                fire("tokens_per_s", tokens / result.elapsed, length=tokens)
            if guide is not None:
                record["validity"] = check(result.text, guide.schema, tokens, max_tokens)
                fire_validity(record["validity"], elapsed_ms, tokens)
        self.write(record, result)

    def write(self, record: dict, result: StreamResult) -> None:
        if record["window"] >= 0:
            Tracker.outstanding -= 1
        self.current = None
        if not self.options.records:
            return
        metrics = result.metrics
        record.update(
            sent_ns=result.sent_ns,
            done_ns=result.done_ns,
            chunk_ns=result.chunk_ns,
            chunk_tokens=result.chunk_tokens,
            tokens=result.num_output_tokens,
            drafted=int(metrics.get("total_draft_tokens", 0)),
        )
        for name in ("arrival", "first_scheduled", "first_token", "last_token"):
            record[f"{name}_ns"] = int(metrics.get(f"{name}_time_ns", 0))
        with open(self.options.records, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def stopped(self) -> None:
        """Locust stopped the user mid-request: record what it had (outcome unfinished)."""
        if self.current is not None:
            record, result = self.current
            record["outcome"] = "unfinished"
            result.done_ns = result.done_ns or time.time_ns()
            self.write(record, result)


def fire(name: str, value_ms: float, length: int = 0, exception: str | None = None) -> None:
    events.request.fire(
        request_type="stream",
        name=name,
        response_time=value_ms,
        response_length=length,
        exception=None if exception is None else RuntimeError(exception),
        context={},
    )


# A guided answer's Locust entry (`structured_output`): a success when valid under its schema,
# else a failure with one of these messages (Locust's failures table counts each apart).
VALIDITY_FAILURES = {"invalid": "invalid under its schema", "cut": "cut by max_tokens"}


def fire_validity(verdict: str, elapsed_ms: float, tokens: int) -> None:
    """The `structured_output` entry of one guided answer (structured.check's verdict)."""
    fire("structured_output", elapsed_ms, length=tokens, exception=VALIDITY_FAILURES.get(verdict))


class GrpcUser(StreamingUser, User):
    """Streams over gRPC on the process's shared channels (one StreamPool per host)."""

    pools: dict[str, StreamPool] = {}

    def on_start(self) -> None:
        self.setup()
        host = self.host or "127.0.0.1:8001"
        if host not in self.pools:
            self.pools[host] = StreamPool(host, self.options.model, self.options.grpc_channels)
        self.pool = self.pools[host]
        self.render = raw_text if self.options.raw_prompts else chat_format

    def on_stop(self) -> None:
        self.stopped()

    @task
    def generate(self) -> None:
        record = self.next_request()
        params = self.params(record["mode"])
        params.update(
            stream=True,
            exclude_input_in_output=True,
            return_num_output_tokens=True,
            return_perf_metrics=True,
        )

        def on_chunk(result: StreamResult) -> None:
            self.current = (record, result)

        prompt = self.render(self.walk.next_request())
        guide = self.walk.guide()
        result = self.pool.generate(
            prompt,
            timeout=self.options.stream_timeout,
            on_chunk=on_chunk,
            **params,
            **guide_inputs(guide),
        )
        self.walk.answered(result.text if result.error is None else None)
        self.finish(record, result, guide, params["max_tokens"])


class OpenAIUser(StreamingUser, FastHttpUser):
    """Streams /v1/chat/completions (--openai-completions: /v1/completions) as server-sent
    events, with stream_options.include_usage for the token count. The OpenAI wire format
    carries no server times: its records have no server TTFT, and a chunk counts as one
    token until the usage chunk gives the total. Of a mode only num_draft_tokens travels
    (the API's extension field): k0 and adaptive mean what they mean over gRPC."""

    # Run it by name (`locust -f loadtest/locustfile.py OpenAIUser --host http://h:9000`);
    # otherwise Locust would run it beside GrpcUser.
    abstract = "OpenAIUser" not in sys.argv
    models: dict[str, str] = {}  # host -> the model name the server serves

    def on_start(self) -> None:
        self.setup()
        if self.host not in self.models:
            with self.client.get("/v1/models", name="/v1/models") as response:
                self.models[self.host] = response.json()["data"][0]["id"]

    def on_stop(self) -> None:
        self.stopped()

    def body(self, mode: str) -> tuple[str, dict]:
        params = self.params(mode)
        body = {
            "model": self.models[self.host],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": params["max_tokens"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
        }
        for name in ("seed", "num_draft_tokens", "cache_salt"):
            if name in params:
                body[name] = params[name]
        messages = self.walk.next_request()
        guide = self.walk.guide()
        if guide is not None:
            body["response_format"] = response_format(guide)
        if self.options.openai_completions:
            return "/v1/completions", {**body, "prompt": raw_text(messages)}
        return "/v1/chat/completions", {**body, "messages": messages}

    @task
    def generate(self) -> None:
        record = self.next_request()
        path, body = self.body(record["mode"])
        guide = self.walk.guide()
        result = StreamResult(sent_ns=time.time_ns())
        self.current = (record, result)
        try:
            # Locust's own entry for this call times the response headers only.
            with self.client.post(
                path, json=body, stream=True, catch_response=True, name=f"{path} (headers)"
            ) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {response.text[:300]}"
                else:
                    read_events(response._response, result)
                response.success()  # the entries below say how the stream went
        except Exception as error:  # the connection broke
            result.error = result.error or f"{type(error).__name__}: {error}"
        result.done_ns = result.done_ns or time.time_ns()
        self.walk.answered(result.text if result.error is None else None)
        self.finish(record, result, guide, body["max_tokens"])


def response_format(guide: Guide) -> dict:
    """A guide as OpenAI's response_format asks for it."""
    if guide.guide_type == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": guide.schema}}


def read_events(stream, result: StreamResult) -> None:
    """An OpenAI event stream into `result`, each event timed as its line arrives.
    `stream.readline` returns a line as soon as it is complete (a sized read would wait
    for its size)."""
    while True:
        line = stream.readline(b"\n")
        if not line:
            result.error = result.error or "the stream ended without [DONE]"
            return
        if line.startswith(b"data:") and sse_data(line[5:].strip(), result, time.time_ns()):
            return


def sse_data(data: bytes, result: StreamResult, now_ns: int) -> bool:
    """One `data:` payload; True at [DONE]."""
    if data == b"[DONE]":
        result.done_ns = now_ns
        return True
    payload = json.loads(data)
    if "error" in payload:
        error = payload["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        return False
    for choice in payload.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            result.text += text
            result.chunk_ns.append(now_ns)
            result.chunk_tokens.append(len(result.chunk_ns))  # a token per chunk, until usage
    usage = payload.get("usage")
    if usage:  # the true count: what the per-chunk guess missed goes to the last chunk
        result.metrics["num_output_tokens"] = usage.get("completion_tokens", 0)
        if result.chunk_tokens:
            result.chunk_tokens[-1] = max(result.chunk_tokens[-1], result.num_output_tokens)
    return False
