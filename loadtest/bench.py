"""Speculative against plain decoding, side by side, on one running server, by workload.

    .venv/bin/python loadtest/bench.py --modes k0,ngram --workloads grounded --concurrency 1

Workloads: `chat` (loadtest/prompts.jsonl), `grounded` (loadtest/prompts_grounded.jsonl:
answers that copy or rework text given in the prompt) and `rewrite`
(loadtest/prompts_rewrite.jsonl: answers that rework the text given rather than copy it:
restyled, restructured, summarised, retold or shortened), and for the server's prefix reuse
`shared-prefix` (one system text of about 1,000 tokens, then a short question) and
`multi-turn` (conversations of four user turns; each request resends the history with the
answers this stream got in this mode: see StaggeredLoad), and `agentic` (loadtest/agentic.py:
an agent's tool calls in one JSON format, conversations of two or three turns, generated
without end; each mode, level and warm-up walks tasks of its own, so that no prompt is sent
twice in a run), and `structured` (loadtest/structured.py: JSON extraction and tool calls,
each request with the JSON schema its answer must follow, sent as guided_decoding_guide_type
and guided_decoding_guide; its answers are counted valid, invalid or cut by max_tokens, and
its requests ask for at least structured.MAX_TOKENS tokens). Modes: k0 (no speculation),
draft, ngram and suffix (one proposer alone, k chosen by the server; suffix needs a server
with PROPOSERS=...,suffix), adaptive (the server's choice of proposer and k per row),
adaptive-nosuffix (the same among draft_model and ngram), k2/k4/k8 (the draft model at a
fixed k), k0-again (the noise floor).
Any mode takes the suffixes `-sampled` (temperature 0.8 instead of greedy), one of
`-penalized`, `-penalized-prompt` and `-controlcost` (presence and frequency penalties:
common.CONTROLS) and `-si<N>` (the request's stream_interval: a response each time N output
tokens have gathered), in that order, e.g. `k4-sampled-si16`; each is compared with k0 of
the same suffixes where the run has it (`make bench-overhead` runs them).

At each concurrency level the modes take turns in two windows each, in mirrored order (k0
k2 k4 adaptive adaptive k4 k2 k0, reversed at the next level), so that drift in the
machine's speed over a level hits every mode alike: on these shared machines the same
target call measured 10% apart a few minutes later. In a window, `concurrency` workers,
each on its own gRPC stream, send streamed greedy requests back to back, their ends
staggered as under real traffic (see StaggeredLoad). Output tokens/s is the server's
emitted-token counter over the windows' steady part. Per level and mode it also records
p50/p99 request latency, time to first token and inter-chunk latency, the acceptance rate,
the share of prompt tokens the server reused from another sequence's cache, and from the
server's counters iterations/s, ms per iteration by loop part and the bytes each engine
call returned (n/a where the server does not count them). Writes
results/<name>.json, .csv and .png and prints tokens/s ratios against k = 0 and the parts.
Without --url it starts its own server.

Then, if asked, k = 0 on a second server that differs in settings, against this server's
k = 0 at one concurrency, in rounds of mirrored windows (see SecondServer):
`--float32-concurrency 32` (what `make bench` runs: the second server in float32), or
`--env-b NAME=VALUE --b-concurrency 32 --b-rounds 2` for any setting (`--concurrency ''`
to measure only that; `--url-b` to point it at a running server). That runs on the first
workload; `--b-workloads each` runs it on each, with k0-again on this server beside
(`make bench-prefix`: the prefix cache on against PREFIX_CACHE=off).

With `--cold-start`, instead: k0, adaptive and k0-again each meet a burst of requests on a
server started for them alone (loadtest/cold_start.py; `make bench-cold`).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cold_start
from common import (
    ENGINE_CALL_KINDS,
    MODES,
    PROPOSER_NAMES,
    TIMED_PARTS,
    VARIANT,
    WORKLOAD_NAMES,
    chat_template,
    deltas,
    finish_axes,
    mirrored_order,
    mode_inputs,
    parse_env,
    per_call,
    per_iteration,
    percentile,
    read_workload,
    server_counters,
    unguided,
    unknown_variants,
)
from specdec.client import GenerationResult, StreamingClient, generate
from specdec.paths import PROJECT_ROOT
from structured import Guide, Tally, check, distinct_guides, guide_inputs
from walks import Message, Walk, Workload

# Requests of one stream that may fail in a row before its window's first token; then the
# run stops with the server's error (a mode the server refuses would spin forever).
MAX_FAILED = 3


@dataclass
class SecondServer:
    """k = 0 on a second server, which differs from the first in `env`, against the first
    server's k = 0 at `concurrency` streams: `rounds` rounds, each giving both servers two
    windows in mirrored order (A B B A, then B A A B), as the modes get at a level."""

    env: dict[str, str]  # on top of --server-env
    concurrency: int
    rounds: int = 1
    mode: str = "k0-b"  # its k = 0's name in the outputs
    workload: str = "env-b"  # what its levels' workload field says (see second_label)
    label: str = "this server against the --env-b one"  # the printed ratio's
    url: str | None = None  # a running server (with metrics_url); None: one of bench's own
    metrics_url: str | None = None
    # False: on the run's first workload; True: on each, with k0-again on the first server
    # (--b-workloads each: PREFIX_CACHE=off against on needs the prefix workloads)
    each_workload: bool = False


def float32_server(concurrency: int) -> SecondServer:
    """`make bench`'s precision comparison (--float32-concurrency): the second server in
    float32."""
    return SecondServer(
        {"DTYPE": "float32"},
        concurrency,
        mode="k0-float32",
        workload="dtype",
        label="this server's dtype against float32",
    )


@dataclass
class BenchConfig:
    modes: list[str]
    concurrency: list[int]
    max_tokens: int = 128  # a workload may ask for more (structured: walks.Workload.max_tokens)
    level_seconds: float = 40.0  # of sustained load per level and mode, in two windows
    url: str | None = None  # None: start a server of our own
    metrics_url: str | None = None  # with url: its metrics endpoint (steady-state tokens/s)
    model: str = "ensemble"
    workloads: list[str] = field(default_factory=lambda: ["chat"])
    out_dir: Path = PROJECT_ROOT / "results"
    name: str = "bench"
    server_env: dict[str, str] = field(default_factory=dict)
    second: SecondServer | None = None  # then k = 0 against a second server (None: not)

    def validate(self) -> None:
        unknown = unknown_variants(self.modes)
        if unknown:
            raise ValueError(
                f"--modes: unknown {', '.join(unknown)}; of {', '.join(MODES)}, each optionally "
                "followed by -sampled, -penalized[-prompt] or -controlcost, and -si<N>"
            )
        if not self.workloads or [w for w in self.workloads if w not in WORKLOAD_NAMES]:
            raise ValueError(f"--workloads: of {', '.join(WORKLOAD_NAMES)}")
        if not (self.modes and self.concurrency) and self.second is None:
            raise ValueError("nothing to measure: no modes or levels, and no second server")
        if self.second is not None and min(self.second.concurrency, self.second.rounds) < 1:
            raise ValueError("the second server: at least one stream and one round")


@dataclass
class LevelResult:
    workload: str
    mode: str
    concurrency: int
    num_requests: int
    num_errors: int
    output_tokens: int
    counted_s: float  # the windows' length
    tokens_per_s: float  # in the windows, every stream busy in this mode (server counter)
    window_tokens_per_s: list[float]  # each window's own figure: the spread drift leaves
    acceptance_rate: float
    draft_tokens_per_output_token: float  # how much the mode speculated
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    inter_chunk_p50_s: float
    inter_chunk_p99_s: float
    # From the server's counters over the counted windows (0 without a metrics endpoint):
    # tokens per loop iteration and where an iteration's time went.
    tokens_per_iteration: float = 0.0
    cancel_check_ms_per_iteration: float = 0.0
    draft_ms_per_iteration: float = 0.0
    target_ms_per_iteration: float = 0.0
    schedule_ms_per_iteration: float = 0.0
    respond_ms_per_iteration: float = 0.0
    outbox_ms_per_iteration: float = 0.0  # sending, metric updates (inline: within respond)
    iterations_per_s: float = 0.0
    # The mode's decoding (mode_inputs): 0 = greedy; a response per stream_interval tokens.
    temperature: float = 0.0
    stream_interval: int = 1
    # Engine calls per iteration and bytes each returned, by kind (common.per_call; None: the
    # server does not count them, or made no such call).
    draft_calls_per_iteration: float | None = None
    draft_bytes_per_call: float | None = None
    target_calls_per_iteration: float | None = None
    target_bytes_per_call: float | None = None
    # Of the requests' prompt tokens, those the server took from another sequence's cache
    # (kv_cache_reused_blocks / num_input_tokens; 0 where the server reuses none).
    reused_prompt_fraction: float = 0.0
    # Each proposer's draft tokens and those accepted, over the counted windows (the server's
    # specdec_proposer_*_tokens_total): a mixed mode's share by proposer.
    draft_model_draft_tokens: float = 0.0
    draft_model_accepted: float = 0.0
    ngram_draft_tokens: float = 0.0
    ngram_accepted: float = 0.0
    suffix_draft_tokens: float = 0.0
    suffix_accepted: float = 0.0
    grammar_draft_tokens: float = 0.0
    grammar_accepted: float = 0.0
    # Of the answers to guided requests (structured), those valid under their schema, those
    # that broke it and those cut by max_tokens (structured.check); None: no guided request.
    valid_outputs: int | None = None
    invalid_outputs: int | None = None
    cut_outputs: int | None = None


@dataclass
class Request:
    """One request of a window, and what came back."""

    window: int  # the index of the window it belongs to
    result: GenerationResult | None = None  # once it has finished
    guide: Guide | None = None  # its guided decoding (structured); None: free text
    max_tokens: int = 0  # as sent


@dataclass
class MeasuredWindow:
    """One mode's stretch of steady load, and the server's count of tokens emitted in it
    (schedule.PlannedWindow is `make loadtest`'s: a planned stretch, measured afterwards)."""

    index: int
    mode: str
    start: float
    end: float
    tokens: float | None  # None: no metrics endpoint to count them
    counters: dict[str, float] = field(default_factory=dict)  # server_counters' deltas


class ModeParts:
    """Which part of a unique workload's tasks (walks.PART_SIZE) each mode of one load
    walks: a fresh one from the run's counter the first time a mode asks, so that no prompt
    is sent twice in a run (a store of earlier answers, fed by one mode, would hand the next
    mode the answers to its own prompts). The counter is the run's: every load and warm-up
    draws from it. Thread-safe: a window's streams ask at once."""

    def __init__(self, counter: Iterator[int]):
        self.counter = counter
        self.parts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, mode: str) -> int:
        with self.lock:
            if mode not in self.parts:
                self.parts[mode] = next(self.counter)
            return self.parts[mode]


class StreamPrompts:
    """One stream's prompts: a walk of the workload per mode, each from its start, so that
    every mode sends the same sequence however the windows cut it (a multi-turn walk keeps
    the answers its own mode got); a unique workload's (agentic) walk takes its mode's own
    part of the tasks (`part_of`), so that no two modes send the same prompt."""

    def __init__(
        self,
        workload: Workload,
        index: int,
        concurrency: int,
        render: Callable[[list[Message]], str],
        part_of: Callable[[str], int] = lambda mode: 0,
    ):
        self.workload, self.render, self.part_of = workload, render, part_of
        self.index, self.concurrency = index, concurrency
        self.walks: dict[str, Walk] = {}  # mode -> its walk

    def next_prompt(self, mode: str) -> str:
        if mode not in self.walks:
            part = self.part_of(mode)
            self.walks[mode] = self.workload.stream_walk(self.index, self.concurrency, part)
        return self.render(self.walks[mode].next_request())

    def guide(self, mode: str) -> Guide | None:
        """The guide of `mode`'s last prompt (None: free text)."""
        return self.walks[mode].guide()

    def answered(self, mode: str, answer: str | None) -> None:
        """The answer to `mode`'s last prompt (None: the request failed)."""
        self.walks[mode].answered(answer)


class StaggeredLoad:
    """`concurrency` streams, each sending streamed greedy requests back to back in the mode
    of the current window, their ends staggered as under real traffic.

    A window starts every stream at once, stream i with a lead-in request (not reported) for
    (i + 1) / concurrency of `max_tokens`; from then on the streams' requests end at staggered
    times. Counting opens once every stream has had a token of the window's mode (the lead-
    ins' prefills are behind) and lasts `seconds`; then no new request leaves, and the window
    ends when the requests under way have finished, so that no request shares a batch with
    another mode's (they run on, at falling concurrency: their latencies are a little low).
    Staggered, because streams started at once open every window with a prefill of every
    prompt, which steady traffic never sees (the measurements: docs/benchmarks.md, the
    method).

    Each stream walks the workload (walks.py) once per mode: a multi-turn stream keeps each
    mode's conversation, and the answers its requests got in that mode, across that mode's
    windows; a window's end does not end a conversation, the mode's next window goes on
    with its next turn. A lead-in request is a turn like the others (its answer, shorter,
    is kept). On a unique workload (agentic) each mode walks a part of the tasks drawn from
    `parts`, the run's counter (ModeParts)."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        workload: Workload,
        config: BenchConfig,
        metrics_url: str | None = None,
        render: Callable[[list[Message]], str] | None = None,  # default: the chat template
        *,
        parts: Iterator[int],
    ):
        self.url, self.concurrency, self.workload, self.config = url, concurrency, workload, config
        self.metrics_url = metrics_url
        self.render = render or chat_template()
        self.part_of = ModeParts(parts)
        self.requests: list[Request] = []  # lead-ins left out
        self.windows: list[MeasuredWindow] = []
        self.mode: str | None = None  # None: between windows, no request leaves
        self.busy = [False] * concurrency  # a request under way
        self.first_token = [False] * concurrency  # the stream has had a token this window
        self.stopping = False
        self.num_failed = [0] * concurrency  # requests failed before the window's first token
        self.failure: str | None = None  # set once a stream has had MAX_FAILED of them
        self.changed = threading.Condition()
        self.threads = [
            threading.Thread(target=self._stream, args=(i,), daemon=True)
            for i in range(concurrency)
        ]
        for thread in self.threads:
            thread.start()

    def cache_salt(self, mode: str) -> str | None:
        """A workload that sends every mode the same prompts (all but agentic) runs each mode
        and level under a salt of its own: otherwise the suffix store (and the prefix cache)
        would hand a mode the answers another mode, or a lower level, got to the same
        prompts. A unique workload shares the store, as real traffic does (None: no salt)."""
        if self.workload.unique:
            return None
        return f"bench-{mode}-{self.concurrency}"

    def _stream(self, index: int) -> None:
        def on_chunk(_chunk: str) -> None:
            self.first_token[index] = True

        # Each mode walks the same prompt sequence from its start (stream i: prompts i, i + c,
        # i + 2c, ...; multi-turn: conversations i, i + c, ..., turn by turn), so that the modes
        # are compared on the same prompts: a window holds few requests, and prompts differ a
        # lot (what a shared count did: docs/benchmarks-archive.md, "The modes did not see the same
        # prompts"). Not on a unique workload (agentic), where each mode has tasks of its own.
        prompts = StreamPrompts(self.workload, index, self.concurrency, self.render, self.part_of)
        with StreamingClient(self.url, self.config.model) as client:
            window_seen = -1
            while True:
                with self.changed:
                    self.busy[index] = False
                    self.changed.notify_all()
                    self.changed.wait_for(lambda: self.stopping or self.mode is not None)
                    if self.stopping:
                        return
                    mode, window = self.mode, len(self.windows)
                    self.busy[index] = True
                    request = Request(window)
                    max_tokens = self.workload.max_tokens(self.config.max_tokens)
                    if window != window_seen:  # the window's first request: a lead-in
                        window_seen = window
                        max_tokens = max(1, round(max_tokens * (index + 1) / self.concurrency))
                    else:
                        self.requests.append(request)
                prompt = prompts.next_prompt(mode)
                request.guide = None if unguided(mode) else prompts.guide(mode)
                request.max_tokens = max_tokens
                request.result = client.generate(
                    prompt,
                    max_tokens=max_tokens,
                    stream=True,
                    cache_salt=self.cache_salt(mode),
                    **mode_inputs(mode),
                    **guide_inputs(request.guide),
                    return_perf_metrics=True,
                    return_num_input_tokens=True,
                    return_num_output_tokens=True,
                    exclude_input_in_output=True,
                    on_chunk=on_chunk,
                )
                error = request.result.error
                prompts.answered(mode, request.result.text if error is None else None)
                if error is not None and not self.first_token[index]:
                    self.num_failed[index] += 1
                    if self.num_failed[index] >= MAX_FAILED:
                        self.failure = f"{mode}: {error.message()}"

    def _wait(self, condition: Callable[[], bool]) -> None:
        with self.changed:
            while not self.changed.wait_for(condition, timeout=0.05):
                if not all(thread.is_alive() for thread in self.threads):
                    raise RuntimeError("a load stream died (the server stopped answering?)")
                if self.failure is not None:  # the window would wait for its first token forever
                    raise RuntimeError(f"requests fail before any token: {self.failure}")

    def window(self, mode: str, seconds: float) -> MeasuredWindow:
        """`seconds` of steady load in `mode`, counted; returns once the load has drained."""
        with self.changed:
            self.first_token = [False] * self.concurrency
            self.num_failed = [0] * self.concurrency
            self.mode = mode
            self.changed.notify_all()
        self._wait(lambda: all(self.first_token))
        start, before = time.perf_counter(), server_counters(self.metrics_url)
        time.sleep(seconds)
        after = server_counters(self.metrics_url)
        end = time.perf_counter()
        with self.changed:
            self.mode = None
        self._wait(lambda: not any(self.busy))
        counted = deltas(before, after)
        tokens = counted["tokens"] if counted else None
        window = MeasuredWindow(len(self.windows), mode, start, end, tokens, counted)
        self.windows.append(window)
        return window

    def stop(self) -> list[Request]:
        """Ends the streams; every request but the lead-ins, with its result."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        for thread in self.threads:
            thread.join()
        return self.requests


def summarize(
    workload: str,
    mode: str,
    concurrency: int,
    windows: list[MeasuredWindow],
    requests: list[Request],
) -> LevelResult:
    """One mode at one level: its windows' tokens/s, and their requests."""
    indices = {w.index for w in windows}
    mine = [r for r in requests if r.window in indices]
    ok = [r.result for r in mine if r.result.error is None]

    def tokens_of(results) -> int:
        return sum(int(result.metrics.get("num_output_tokens", 0)) for result in results)

    counted = []  # tokens per window; without the server's counter, those of its requests
    for w in windows:
        own = [r.result for r in mine if r.window == w.index and r.result.error is None]
        counted.append(w.tokens if w.tokens is not None else tokens_of(own))
    seconds = sum(w.end - w.start for w in windows)
    tokens = tokens_of(ok)
    drafted = sum(r.metrics.get("total_draft_tokens", 0) for r in ok)
    accepted = sum(r.metrics.get("total_accepted_draft_tokens", 0) for r in ok)
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times)]
    latencies = [r.elapsed for r in ok]
    ttfts = [r.time_to_first_token for r in ok if r.time_to_first_token is not None]
    prompt_tokens = sum(r.metrics.get("num_input_tokens", 0) for r in ok)
    reused_tokens = sum(r.metrics.get("kv_cache_reused_blocks", 0) for r in ok)
    totals = {
        name: sum(w.counters.get(name, 0.0) for w in windows)
        for name in ("tokens", "iterations", *TIMED_PARTS)
    }
    inputs = mode_inputs(mode)
    return LevelResult(
        workload=workload,
        mode=mode,
        concurrency=concurrency,
        num_requests=len(mine),
        num_errors=len(mine) - len(ok),
        output_tokens=tokens,
        counted_s=seconds,
        tokens_per_s=sum(counted) / seconds,
        window_tokens_per_s=[
            round(n / (w.end - w.start), 2) for n, w in zip(counted, windows, strict=True)
        ],
        acceptance_rate=accepted / drafted if drafted else 0.0,
        draft_tokens_per_output_token=drafted / tokens if tokens else 0.0,
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        inter_chunk_p50_s=percentile(gaps, 50),
        inter_chunk_p99_s=percentile(gaps, 99),
        **per_iteration(totals),
        iterations_per_s=totals["iterations"] / seconds,
        temperature=inputs.get("temperature", 0.0),
        stream_interval=inputs.get("stream_interval", 1),
        **engine_calls(windows, totals["iterations"]),
        reused_prompt_fraction=reused_tokens / prompt_tokens if prompt_tokens else 0.0,
        **{
            key: sum(w.counters.get(key, 0.0) for w in windows)
            for name in PROPOSER_NAMES
            for key in (f"{name}_draft_tokens", f"{name}_accepted")
        },
        **validity(mine),
    )


def validity(requests: list[Request]) -> dict[str, int | None]:
    """valid_outputs, invalid_outputs and cut_outputs of the answered requests that carried
    a guide (structured.check); None each where none did."""
    guided = [r for r in requests if r.guide is not None and r.result.error is None]
    if not guided:
        return dict.fromkeys(("valid_outputs", "invalid_outputs", "cut_outputs"))
    tally = Tally()
    for r in guided:
        tokens = int(r.result.metrics.get("num_output_tokens", 0))
        tally.add(check(r.result.text, r.guide.schema, tokens, r.max_tokens))
    return {
        "valid_outputs": tally.valid,
        "invalid_outputs": tally.invalid,
        "cut_outputs": tally.cut,
    }


def engine_calls(windows: list[MeasuredWindow], iterations: float) -> dict[str, float | None]:
    """Engine calls per iteration and bytes per call over the windows (common.per_call),
    from the counters that every window has."""
    names = [f"{call}_{what}" for call in ENGINE_CALL_KINDS for what in ("calls", "result_bytes")]
    totals = {
        name: sum(w.counters[name] for w in windows)
        for name in names
        if windows and all(name in w.counters for w in windows)
    }
    return per_call({"iterations": iterations, **totals})


def window_schedule(modes: list[str], level_index: int, rounds: int = 1) -> list[str]:
    """The modes' windows at one level: each round gives every mode two, in mirrored order
    (A B C C B A), the order reversed from level to level and from round to round."""
    return [m for r in range(rounds) for m in mirrored_order(modes, level_index + r)]


def baseline(mode: str, modes: list[str]) -> str | None:
    """The mode `mode` is compared with: k0 with the same variant suffixes (k4-sampled-si16:
    k0-sampled-si16) where the run has it, else k0 (k0-sampled-si16: k0); None for k0 itself
    and where the run has neither."""
    match = VARIANT.fullmatch(mode)
    suffixes = mode[len(match["base"]) :] if match else ""
    for candidate in (f"k0{suffixes}", "k0"):
        if candidate in modes and candidate != mode:
            return candidate
    return None


def ratio_table(levels: list[LevelResult], modes: list[str]) -> str:
    """tokens/s per workload, level and mode, and each mode's ratio to its baseline (k0 of
    the same level and variant)."""
    by_key = {(r.workload, r.mode, r.concurrency): r for r in levels}
    compared = [(m, b) for m in modes if (b := baseline(m, modes)) is not None]
    header = "| workload | concurrency | " + " | ".join(f"{m} tok/s" for m in modes)
    if compared:
        header += " | " + " | ".join(f"{m}/{b}" for m, b in compared)
    lines = [header + " |", "|" + "---|" * (header.count("|") - 1)]
    for workload, c in sorted({(r.workload, r.concurrency) for r in levels}):
        row = [f"{by_key[(workload, m, c)].tokens_per_s:.1f}" for m in modes]
        row += [
            f"{by_key[(workload, m, c)].tokens_per_s / by_key[(workload, b, c)].tokens_per_s:.2f}x"
            for m, b in compared
        ]
        lines.append(f"| {workload} | {c} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _bytes(value: float | None, counted: bool) -> str:
    """Bytes per call for a table: n/a where the server does not count them, - for no call."""
    if value is None:
        return "-" if counted else "n/a"
    if value >= 1e5:
        return f"{value / 1e6:.2f} MB"
    return f"{value / 1e3:.1f} kB" if value >= 1e3 else f"{value:.0f} B"


def parts_table(levels: list[LevelResult]) -> str:
    """Per level and mode: tokens/s, iterations/s, ms per iteration by loop part and the
    bytes each engine call returned."""
    parts = " | ".join(f"{part} ms" for part in TIMED_PARTS)
    header = (
        f"| workload | streams | mode | tok/s | it/s | tokens/it | {parts} | "
        "draft B/call | target B/call |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in sorted(levels, key=lambda r: (r.workload, r.concurrency)):
        ms = " | ".join(f"{getattr(r, f'{part}_ms_per_iteration'):.1f}" for part in TIMED_PARTS)
        lines.append(
            f"| {r.workload} | {r.concurrency} | {r.mode} | {r.tokens_per_s:.1f} | "
            f"{r.iterations_per_s:.1f} | {r.tokens_per_iteration:.1f} | {ms} | "
            f"{_bytes(r.draft_bytes_per_call, r.draft_calls_per_iteration is not None)} | "
            f"{_bytes(r.target_bytes_per_call, r.target_calls_per_iteration is not None)} |"
        )
    return "\n".join(lines)


def validity_table(levels: list[LevelResult]) -> str:
    """Per level and mode with guided requests: answers valid under their schema, invalid,
    and cut by max_tokens."""
    header = "| workload | streams | mode | valid | invalid | cut |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in sorted(levels, key=lambda r: (r.workload, r.concurrency)):
        if r.valid_outputs is not None:
            lines.append(
                f"| {r.workload} | {r.concurrency} | {r.mode} | {r.valid_outputs} | "
                f"{r.invalid_outputs} | {r.cut_outputs} |"
            )
    return "\n".join(lines)


def noise_floor(levels: list[LevelResult]) -> float | None:
    """The run's lowest k0-again / k0 ratio: a mode equal to k0 can read this low."""
    by_key = {(r.workload, r.mode, r.concurrency): r.tokens_per_s for r in levels}
    ratios = [
        value / by_key[(w, "k0", c)]
        for (w, mode, c), value in by_key.items()
        if mode == "k0-again" and by_key.get((w, "k0", c))
    ]
    return min(ratios) if ratios else None


def plot(levels: list[LevelResult], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in levels})
    width = len(workloads)
    fig, axes = plt.subplots(2, width, figsize=(5.5 * width, 8.4), squeeze=False)
    for column, workload in enumerate(workloads):
        for mode in modes:
            rows = sorted(
                (r for r in levels if r.mode == mode and r.workload == workload),
                key=lambda r: r.concurrency,
            )
            streams = [r.concurrency for r in rows]
            axes[0][column].plot(streams, [r.tokens_per_s for r in rows], marker="o", label=mode)
            loop_ms = [1000 / r.iterations_per_s if r.iterations_per_s else 0.0 for r in rows]
            axes[1][column].plot(streams, loop_ms, marker="o", label=mode)
    finish_axes(
        [(axis, f"{w}: output tokens/s") for axis, w in zip(axes[0], workloads, strict=True)]
        + [(axis, f"{w}: ms per iteration") for axis, w in zip(axes[1], workloads, strict=True)],
        "concurrent streams",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(levels: list[LevelResult], config: BenchConfig, meta: dict) -> Path:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    base = config.out_dir / config.name
    rows = [asdict(r) for r in levels]
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "levels": rows}, indent=2))
    with base.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(levels, config.modes, base.with_suffix(".png"))
    return base


def _seconds(value: float | None) -> str:
    """A latency for the log; '-' where a mode finished no counted request (a window shorter
    than its lead-in request, on a slow machine)."""
    return "     -" if value is None else f"{value:6.2f} s"


def warm_up(
    workload: Workload, render: Callable[[list[Message]], str], url: str, model: str, part: int
) -> None:
    """A short request of the workload (of `part`, for a unique one), and one for each guide
    it has (structured): a server meets each grammar first here, not in a mode's window."""
    generate(render(workload.first_request(part)), url, model, max_tokens=8)
    for messages, guide in distinct_guides(workload.requests, workload.guides):
        generate(render(messages), url, model, max_tokens=8, **guide.inputs())


def run_level(
    workload: str,
    concurrency: int,
    modes: list[str],
    level_index: int,
    loads: dict[str, StaggeredLoad],
    config: BenchConfig,
    rounds: int = 1,
) -> list[LevelResult]:
    """One level: each mode's windows in mirrored order, `config.level_seconds` per mode and
    round. `loads`: mode -> StaggeredLoad (a mode may run on a server of its own, as the
    second server's k = 0 does)."""
    schedule = window_schedule(modes, level_index, rounds)
    seconds = config.level_seconds / 2  # in two windows per mode and round
    windows = [loads[mode].window(mode, seconds) for mode in schedule]
    distinct = {id(load): load for load in loads.values()}  # modes may share one load
    requests = {key: load.stop() for key, load in distinct.items()}
    results = []
    for mode in modes:
        mine = [w for w in windows if w.mode == mode]
        level = summarize(workload, mode, concurrency, mine, requests[id(loads[mode])])
        results.append(level)
        print(
            f"{workload:<9} c={concurrency:<3} {mode:<9} {level.tokens_per_s:7.1f} tok/s "
            f"(windows {', '.join(f'{x:.1f}' for x in level.window_tokens_per_s)})  "
            f"p99 latency {_seconds(level.latency_p99_s)}  "
            f"ttft p50/p99 {_seconds(level.ttft_p50_s)} /{_seconds(level.ttft_p99_s)}  "
            f"reused prompt {level.reused_prompt_fraction:.0%}  "
            f"acceptance {level.acceptance_rate:.2f}  "
            f"drafted/token {level.draft_tokens_per_output_token:.2f}  "
            f"errors {level.num_errors}  "
            f"ms/iteration: target {level.target_ms_per_iteration:.1f} "
            f"draft {level.draft_ms_per_iteration:.1f} "
            f"respond {level.respond_ms_per_iteration:.1f} "
            f"(outbox {level.outbox_ms_per_iteration:.1f})  "
            f"tokens/iteration {level.tokens_per_iteration:.1f}  "
            f"iterations/s {level.iterations_per_s:.1f}  bytes/call: draft "
            f"{_bytes(level.draft_bytes_per_call, level.draft_calls_per_iteration is not None)} "
            f"target "
            f"{_bytes(level.target_bytes_per_call, level.target_calls_per_iteration is not None)}"
            f"{_validity(level)}",
            flush=True,
        )
    return results


def _validity(level: LevelResult) -> str:
    """The level's guided answers for the log: valid, invalid, cut; '' without any."""
    if level.valid_outputs is None:
        return ""
    tally = Tally(level.valid_outputs, level.invalid_outputs or 0, level.cut_outputs or 0)
    return f"  {tally}"


def run_modes(config: BenchConfig, url: str, parts: Iterator[int]) -> list[LevelResult]:
    """The modes at every level of every workload, on the first server. `parts`: the run's
    counter of a unique workload's parts (ModeParts)."""
    levels: list[LevelResult] = []
    render = chat_template()
    for name in config.workloads:
        workload = read_workload(name)
        warm_up(workload, render, url, config.model, next(parts))
        for i, concurrency in enumerate(config.concurrency):
            load = StaggeredLoad(
                url, concurrency, workload, config, config.metrics_url, render, parts=parts
            )
            loads = {mode: load for mode in config.modes}
            levels += run_level(name, concurrency, config.modes, i, loads, config)
    return levels


def run_second(
    config: BenchConfig,
    second: SecondServer,
    url: str,
    url_b: str,
    metrics_url_b: str | None,
    parts: Iterator[int],
) -> list[LevelResult]:
    """k = 0 on the first server against k = 0 on the second: on the first workload, or with
    `second.each_workload` on each (and k0-again on the first server: each one's noise
    floor). `parts`: the run's counter, as run_modes'."""
    render = chat_template()
    names = config.workloads if second.each_workload else config.workloads[:1]
    c = second.concurrency
    levels = []
    for i, name in enumerate(names):
        workload = read_workload(name)
        for warm in (url, url_b):
            warm_up(workload, render, warm, config.model, next(parts))
        load = StaggeredLoad(url, c, workload, config, config.metrics_url, render, parts=parts)
        loads = {
            "k0": load,
            second.mode: StaggeredLoad(
                url_b, c, workload, config, metrics_url_b, render, parts=parts
            ),
        }
        if second.each_workload:
            loads["k0-again"] = load
        label = second_label(second, name)
        levels += run_level(label, c, list(loads), i, loads, config, second.rounds)
    return levels


def second_label(second: SecondServer, workload: str) -> str:
    """The workload field of the second server's levels: second.workload alone, or with
    each_workload `<second.workload>:<workload>` (apart from the modes' levels)."""
    return f"{second.workload}:{workload}" if second.each_workload else second.workload


def is_second(level: LevelResult, second: SecondServer | None) -> bool:
    """Whether `level` is one of the second server's comparison."""
    if second is None:
        return False
    return level.workload == second.workload or level.workload.startswith(f"{second.workload}:")


def run(config: BenchConfig) -> list[LevelResult]:
    """Measures what `config` asks for; writes <out_dir>/<name>.json, .csv and .png."""
    from specdec.harness import ManagedServer

    config.validate()
    second = config.second
    servers = []
    if config.url is None:
        servers.append(ManagedServer(f"bench-{config.name}", config.server_env))
        config.metrics_url = servers[0].metrics_url
    url = config.url or servers[0].url
    levels: list[LevelResult] = []
    parts = itertools.count()  # a unique workload's parts: one per mode, load and warm-up
    try:
        if config.modes and config.concurrency:
            levels += run_modes(config, url, parts)
        if second is not None:
            url_b, metrics_url_b = second.url, second.metrics_url
            if url_b is None:
                env = {**config.server_env, **second.env}
                own = ManagedServer(f"bench-{config.name}-{second.mode}", env)
                servers.append(own)
                url_b, metrics_url_b = own.url, own.metrics_url
            levels += run_second(config, second, url, url_b, metrics_url_b, parts)
    finally:
        for server in servers:
            server.stop()
    meta = {
        "max_tokens": config.max_tokens,
        "level_seconds": config.level_seconds,
        "model": config.model,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "server_env": config.server_env,
        "noise_floor": noise_floor(levels),
    }
    if second is not None:
        meta["second_server"] = {
            "env": second.env,
            "concurrency": second.concurrency,
            "rounds": second.rounds,
            "url": second.url,  # None: one of bench's own
            "each_workload": second.each_workload,
        }
    base = write_outputs(levels, config, meta)
    report(levels, config, meta)
    print(f"wrote {base}.json, .csv, .png")
    return levels


def report(levels: list[LevelResult], config: BenchConfig, meta: dict) -> None:
    """The ratio table, the noise floor and the second server's ratio, printed."""
    second = config.second
    by_modes = [r for r in levels if not is_second(r, second)]
    if by_modes:
        print(ratio_table(by_modes, config.modes))
        print(f"noise floor (lowest k0-again / k0 of the run): {meta['noise_floor']}")
    print(parts_table(levels))
    if any(r.valid_outputs is not None for r in levels):
        print(validity_table(levels))
    if second is None:
        return
    by_label: dict[str, dict[str, LevelResult]] = {}
    for r in levels:
        if is_second(r, second):
            by_label.setdefault(r.workload, {})[r.mode] = r
    for label, sides in by_label.items():
        a, b = sides["k0"], sides[second.mode]
        where = f" ({label})" if second.each_workload else ""
        again = sides.get("k0-again")
        floor = f"; k0-again / k0 {again.tokens_per_s / a.tokens_per_s:.2f}x" if again else ""
        print(
            f"k = 0 at {second.concurrency} streams{where}, {second.label}: "
            f"{a.tokens_per_s / b.tokens_per_s:.2f}x ({a.tokens_per_s:.1f} / "
            f"{b.tokens_per_s:.1f} tok/s); ttft p50 {_seconds(a.ttft_p50_s)} /"
            f"{_seconds(b.ttft_p50_s)}{floor}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        default="k0,adaptive,k0-again",
        help=f"comma-separated, of {', '.join(MODES)}; each optionally with -sampled "
        "(temperature 0.8), -penalized, -penalized-prompt or -controlcost (common.CONTROLS), "
        "-unguided (structured's prompts without their guides) and -si<N> "
        "(stream_interval N), e.g. k4-sampled-si16",
    )
    parser.add_argument("--workloads", default="chat", help=f"of {', '.join(WORKLOAD_NAMES)}")
    parser.add_argument("--concurrency", default="1,4,16,64", help="'': no levels of the modes")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="structured: at least structured.MAX_TOKENS"
    )
    parser.add_argument(
        "--level-seconds", type=float, default=40.0, help="sustained load per level and mode"
    )
    parser.add_argument(
        "--float32-concurrency",
        type=int,
        default=0,
        help="also k = 0 on a float32 server of its own at this many streams (0: no)",
    )
    parser.add_argument(
        "--env-b",
        default=None,
        help="also k = 0 on a second server of its own with these settings on top of "
        "--server-env, e.g. RESPONSE_THREAD=true",
    )
    parser.add_argument("--b-concurrency", type=int, default=32, help="the second server's")
    parser.add_argument(
        "--b-rounds", type=int, default=1, help="the second server's rounds of windows"
    )
    parser.add_argument(
        "--b-workloads",
        choices=("first", "each"),
        default="first",
        help="the second server on the first of --workloads, or on each (with k0-again on "
        "the first server, each one's noise floor)",
    )
    parser.add_argument("--url-b", default=None, help="a running second server, gRPC host:port")
    parser.add_argument("--metrics-url-b", default=None, help="with --url-b")
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument("--metrics-url", default=None, help="with --url: http://host:8002/metrics")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--name", default="bench", help="<out-dir>/<name>.{json,csv,png}")
    parser.add_argument("--out-dir", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument(
        "--server-env",
        default="",
        help="for the own server, e.g. DTYPE=bfloat16,NUM_SLOTS=64",
    )
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="instead: each arm (k0, adaptive, k0-again) meets a burst on a fresh server of "
        "its own (loadtest/cold_start.py); <out-dir>/<name>-cold.{json,csv}",
    )
    parser.add_argument("--cold-rounds", type=int, default=1, help="with --cold-start")
    parser.add_argument(
        "--cold-max-tokens", type=int, default=64, help="with --cold-start: per request"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = build_parser()
    return bench_config(parser, parser.parse_args(argv))


def bench_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> BenchConfig:
    try:
        config = BenchConfig(
            modes=[m for m in args.modes.split(",") if m],
            concurrency=[int(c) for c in args.concurrency.split(",") if c],
            max_tokens=args.max_tokens,
            level_seconds=args.level_seconds,
            url=args.url,
            metrics_url=args.metrics_url,
            model=args.model,
            workloads=args.workloads.split(","),
            name=args.name,
            out_dir=args.out_dir,
            server_env=parse_env(args.server_env),
            second=second_server(args),
        )
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config


def second_server(args: argparse.Namespace) -> SecondServer | None:
    """--float32-concurrency, or --env-b / --url-b and their --b-* settings; None: neither."""
    other = args.env_b is not None or args.url_b is not None
    if args.float32_concurrency and other:
        raise ValueError("--float32-concurrency or --env-b / --url-b, not both")
    if bool(args.url_b) != bool(args.metrics_url_b):
        raise ValueError("--url-b and --metrics-url-b go together")
    if args.float32_concurrency:
        return float32_server(args.float32_concurrency)
    if not other:
        return None
    return SecondServer(
        parse_env(args.env_b or ""),
        args.b_concurrency,
        args.b_rounds,
        label=f"this server against the one with {args.env_b or 'the same settings'}",
        url=args.url_b,
        metrics_url=args.metrics_url_b,
        each_workload=args.b_workloads == "each",
    )


def cold_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> cold_start.ColdConfig:
    """--cold-start's settings: the workloads, server, name and out-dir as the modes'."""
    try:
        if args.url is not None:
            raise ValueError("--cold-start starts a server per burst: no --url")
        config = cold_start.ColdConfig(
            workloads=args.workloads.split(","),
            server_env=parse_env(args.server_env),
            name=args.name,
            out_dir=args.out_dir,
            model=args.model,
            rounds=args.cold_rounds,
            max_tokens=args.cold_max_tokens,
        )
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cold_start:
        cold_start.run(cold_config(parser, args))
    else:
        run(bench_config(parser, args))


if __name__ == "__main__":
    main()
