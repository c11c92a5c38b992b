"""Locust load test: streamed generations over gRPC with tritonclient.

    .venv/bin/locust -f loadtest/locustfile.py --headless --host 127.0.0.1:8001 \
        -u 64 -r 8 --run-time 2m --csv out

Each user owns one gRPC stream and sends chat prompts from loadtest/prompts.jsonl one after
another. Per request it reports, as Locust entries of type "gRPC":
- `generate`: whole-request latency, response length = output tokens (a failure if the
  server answered with an error; `rejected` instead when it refused for overload);
- `time_to_first_token` and `inter_chunk`: latencies in ms;
- `tokens_per_s`: the request's output tokens per second, in the response-time column.
Options: --max-tokens, --temperature, --top-p, --num-draft-tokens (-1: the server's
choice), --model, --stream-timeout; --ramp runs the 1..256 users ramp (RampShape; --max-users
ends it earlier), --smoke a 30-second one for CI.

Note on tokens/s as an entry: Locust only aggregates times, so the `tokens_per_s` row's
"response time" columns hold tokens per second (higher is better there).
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
import time
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent
from gevent import monkey
from locust import LoadTestShape, User, between, events, task

grpc_gevent.init_gevent()  # before tritonclient creates any channel

from specdec.client import StreamingClient  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.jsonl"
# ChatML as SmolLM2's template writes it (with its default system turn); --raw-prompts sends
# the prompts as they are, for a model with another template.
CHAT_FORMAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
)
OVERLOAD_MARKERS = ("queue full", "shutting down", "UNAVAILABLE")


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--num-draft-tokens", type=int, default=-1, help="-1: leave it to the server (adaptive)"
    )
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--stream-timeout", type=float, default=600.0)
    parser.add_argument("--ramp", action="store_true", help="1, 2, 4 ... 256 users, then stop")
    parser.add_argument("--smoke", action="store_true", help="a 30 s ramp 1, 2, 4 for CI")
    parser.add_argument("--stage-seconds", type=float, default=60.0)
    parser.add_argument("--max-users", type=int, default=256, help="--ramp: the last stage's users")
    parser.add_argument("--raw-prompts", action="store_true", help="no chat format")
    parser.add_argument(
        "--records",
        default="",
        help="append one JSON line per request here (run_loadtest.py reads it)",
    )


EXIT_GRACE_SECONDS = 20.0


@events.quit.add_listener
def bound_the_exit(exit_code: int, **_kwargs) -> None:
    """Locust has written its stats; make sure the process then ends within a grace period.

    In CI, one headless run printed its summary and then never exited: interpreter shutdown
    blocked (gRPC's gevent mode is the likely party; every stream had been closed in
    on_stop). A real OS thread, which gevent's monkey patching does not turn into a
    greenlet, waits out the grace period, dumps every thread's stack to stderr for the
    record, and ends the process with Locust's exit code. A normal exit never meets it."""
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


def load_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines() if line]


PROMPTS = load_prompts()


class StreamingUser(User):
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.options = options
        self.client = StreamingClient(self.host or "127.0.0.1:8001", options.model)
        self.rng = random.Random()
        template = "{prompt}" if options.raw_prompts else CHAT_FORMAT
        self.prompts = [template.format(prompt=p) for p in PROMPTS]

    def on_stop(self) -> None:
        self.client.close()

    def _record(self, **fields) -> None:
        if self.options.records:
            fields.update(t=time.time(), users=self.environment.runner.user_count)
            with open(self.options.records, "a") as handle:
                handle.write(json.dumps(fields) + "\n")

    def _fire(self, name: str, value_ms: float, length: int = 0, exception=None) -> None:
        events.request.fire(
            request_type="gRPC",
            name=name,
            response_time=value_ms,
            response_length=length,
            exception=exception,
            context={},
        )

    @task
    def generate(self) -> None:
        o = self.options
        params = dict(
            max_tokens=o.max_tokens,
            stream=True,
            temperature=o.temperature,
            top_p=o.top_p,
            exclude_input_in_output=True,
            return_num_output_tokens=True,
            return_perf_metrics=True,
        )
        if o.num_draft_tokens >= 0:  # exactly k (0: no speculation)
            params["num_draft_tokens"] = o.num_draft_tokens
            params["fixed_num_draft_tokens"] = True
        if o.temperature > 0:
            params["seed"] = self.rng.randrange(2**32)
        start = time.perf_counter()
        try:
            result = self.client.generate(
                self.rng.choice(self.prompts), timeout=o.stream_timeout, **params
            )
        except Exception as error:  # a stream that broke or timed out
            self._fire("generate", 1000 * (time.perf_counter() - start), exception=error)
            self._record(outcome="broken", elapsed=time.perf_counter() - start)
            self.client.close()
            self.client = StreamingClient(self.host or "127.0.0.1:8001", o.model)
            return
        elapsed_ms = 1000 * result.elapsed
        if result.error is not None:
            message = result.error.message() or str(result.error)
            name = "rejected" if any(m in message for m in OVERLOAD_MARKERS) else "generate"
            self._fire(name, elapsed_ms, exception=RuntimeError(message))
            self._record(outcome=name, elapsed=result.elapsed)
            return
        tokens = int(result.metrics.get("num_output_tokens", 0))
        self._fire("generate", elapsed_ms, length=tokens)
        self._record(
            outcome="ok",
            elapsed=result.elapsed,
            tokens=tokens,
            ttft=result.time_to_first_token,
            drafted=int(result.metrics.get("total_draft_tokens", 0)),
        )
        if result.time_to_first_token is not None:
            self._fire("time_to_first_token", 1000 * result.time_to_first_token)
        for before, after in zip(result.chunk_times, result.chunk_times[1:], strict=False):
            self._fire("inter_chunk", 1000 * (after - before))
        if result.elapsed > 0:
            self._fire("tokens_per_s", tokens / result.elapsed, length=tokens)


RAMP_USERS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
SMOKE_USERS = [1, 2, 4]

if "--ramp" in sys.argv or "--smoke" in sys.argv:  # Locust uses any shape class it finds

    class RampShape(LoadTestShape):
        """1, 2, 4, ... 256 users (--smoke: 1, 2, 4; --max-users: up to that), spawned at
        once so that each stage measures a steady state. A stage holds --stage-seconds plus
        0.5 s per user (with many users the queue is long, and a request takes longer);
        --smoke holds 10 s. Stops by itself after the last stage."""

        def tick(self):
            options = self.runner.environment.parsed_options
            elapsed, run_time = 0.0, self.get_run_time()
            stages = SMOKE_USERS if options.smoke else RAMP_USERS
            for users in [u for u in stages if u <= options.max_users]:
                elapsed += 10.0 if options.smoke else options.stage_seconds + 0.5 * users
                if run_time < elapsed:
                    return users, users
            return None
