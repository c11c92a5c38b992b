"""Bench's cold-start mode (`loadtest/bench.py --cold-start`, `make bench-cold`): each arm
meets a burst on a server started for it alone.

    .venv/bin/python loadtest/bench.py --cold-start --workloads chat --cold-max-tokens 16

For each workload and round, each arm (k0, adaptive, k0-again: the noise floor) gets a fresh
server with the same --server-env, the order reversed from round to round and from workload
to workload (k0 adaptive k0-again, then k0-again adaptive k0), so that drift hits every arm
alike. Once the server is
ready it gets one burst and is stopped: phase "1 stream", 4 requests one after another;
then phase "16 streams", 32 requests that 16 concurrent streams take from a shared queue;
greedy, streamed, 64 output tokens each, the arm's mode inputs (common.mode_inputs). Every
arm's burst sends the same prompts: the workload's 0-3, then 4-35 (wrapping around); but
on `agentic` each burst sends the first turns (system prompt and request) of 36 tasks that
no other burst of the run sends (burst_prompts).

Per phase: the output tokens the responses carried (and the server's counter beside them),
the seconds from the first request sent to the last final response, tokens/s, and what the
server counted meanwhile (iterations, ms per iteration by loop part, each proposer's draft
and accepted tokens: where an arm's time went, printed with each burst). Reported per
workload, phase and round: each arm over k0 (adaptive / k0, and k0-again / k0, the noise
floor), adaptive over both k = 0 servers, and with several rounds the mean of each ratio;
results/<name>-cold.{json,csv}. A fresh server is what every added replica and every
restart meets (issue 30).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import (
    GENERATED,
    PROPOSER_NAMES,
    WORKLOADS,
    accepted_of_drafted,
    chat_template,
    counter_deltas,
    mode_inputs,
    read_workload,
    unknown_variants,
)
from specdec.client import GenerationResult, StreamingClient, scrape_metrics
from specdec.paths import PROJECT_ROOT
from walks import Message, Workload

BASELINE = "k0"  # what every other arm is divided by
AGAIN = "k0-again"  # k = 0 on a server of its own again: the noise floor
ARMS = (BASELINE, "adaptive", AGAIN)
PAIR = f"both {BASELINE}"  # k0 and k0-again together (ratio_rows)
COLD_WORKLOADS = (*WORKLOADS, *GENERATED)  # a request per prompt (agentic: a task's first)


@dataclass(frozen=True)
class Phase:
    """`num_requests` requests taken from a shared queue by `streams` concurrent streams."""

    streams: int
    num_requests: int

    @property
    def name(self) -> str:
        return f"{self.streams} stream{'s' if self.streams > 1 else ''}"


PHASES = (Phase(1, 4), Phase(16, 32))


@dataclass
class ColdConfig:
    workloads: list[str]
    server_env: dict[str, str] = field(default_factory=dict)
    name: str = "bench"
    out_dir: Path = PROJECT_ROOT / "results"
    model: str = "ensemble"
    rounds: int = 1
    max_tokens: int = 64
    arms: tuple[str, ...] = ARMS
    phases: tuple[Phase, ...] = PHASES

    def validate(self) -> None:
        if [w for w in self.workloads if w not in COLD_WORKLOADS]:
            raise ValueError(f"--workloads: of {', '.join(COLD_WORKLOADS)}")
        if BASELINE not in self.arms:
            raise ValueError(f"the arms need {BASELINE}, which the others are divided by")
        if unknown_variants(list(self.arms)):
            raise ValueError(f"unknown arms: {', '.join(unknown_variants(list(self.arms)))}")
        if min(self.rounds, self.max_tokens) < 1:
            raise ValueError("--cold-rounds and --cold-max-tokens: at least 1")


@dataclass
class PhaseResult:
    """One phase of one arm's burst, and the server it ran on."""

    workload: str
    round: int
    arm: str
    phase: str
    streams: int
    num_requests: int
    num_errors: int
    output_tokens: int  # what the responses carried (num_output_tokens)
    server_tokens: float  # the server's emitted-token counter over the phase
    iterations: float  # the server's loop iterations over the phase
    seconds: float  # first request sent to last final response
    tokens_per_s: float  # output_tokens / seconds
    server_pid: int
    grpc_port: int
    requests_at_start: float  # the server's finished requests when it was ready: 0 if fresh
    tokens_per_request: list[int]
    # What the server counted over the phase: tokens per iteration, ms per iteration by loop
    # part, each proposer's draft and accepted tokens (common.counter_deltas): where an arm's
    # time went, and whether its bets paid.
    server: dict[str, float] = field(default_factory=dict)


def burst_plan(num_prompts: int, phases: tuple[Phase, ...] = PHASES) -> list[list[int]]:
    """The prompt indices each phase sends, in order: consecutive from 0 across the phases,
    wrapping around a file shorter than the burst."""
    plan, start = [], 0
    for phase in phases:
        plan.append([(start + i) % num_prompts for i in range(phase.num_requests)])
        start += phase.num_requests
    return plan


def burst_prompts(
    workload: Workload, part: int, count: int, render: Callable[[list[Message]], str]
) -> list[str]:
    """A burst's prompts: the workload's, or for a unique workload (agentic) the first
    turns of `count` tasks of `part`, which the run gives no other burst (a fresh server
    meets prompts it has never seen, nor has any other arm's)."""
    if not workload.unique:
        return [render(messages) for messages in workload.requests]
    first = workload.start(part)
    return [render(workload.opening(first + i)) for i in range(count)]


def arm_order(arms: tuple[str, ...], index: int) -> list[str]:
    """The arms' bursts in round `index` (run: workload + round): in order, reversed every
    other one."""
    return list(arms if index % 2 == 0 else arms[::-1])


def send_phase(
    url: str, model: str, prompts: list[str], streams: int, max_tokens: int, inputs: dict
) -> tuple[list[GenerationResult], float]:
    """`prompts` taken in order by `streams` concurrent streams; the results by prompt, and
    the seconds from the first request sent to the last final response."""
    work: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(prompts):
        work.put(item)
    results: list[GenerationResult | None] = [None] * len(prompts)
    clients = [StreamingClient(url, model) for _ in range(streams)]  # connected beforehand
    finished = [0.0] * streams

    def stream(index: int) -> None:
        while True:
            try:
                i, prompt = work.get_nowait()
            except queue.Empty:
                return
            results[i] = clients[index].generate(
                prompt,
                max_tokens=max_tokens,
                stream=True,
                exclude_input_in_output=True,
                return_num_output_tokens=True,
                **inputs,
            )
            finished[index] = time.perf_counter()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    if any(result is None for result in results):
        raise RuntimeError("a stream died before its requests were answered")
    return [r for r in results if r is not None], max(finished) - start


def measure_phase(server, config: ColdConfig, phase: Phase, prompts: list[str], arm: str) -> dict:
    """One phase on `server`: PhaseResult's counts and times."""
    before = scrape_metrics(server.metrics_url)
    results, seconds = send_phase(
        server.url, config.model, prompts, phase.streams, config.max_tokens, mode_inputs(arm)
    )
    counted = counter_deltas(before, scrape_metrics(server.metrics_url))
    tokens = [int(r.metrics.get("num_output_tokens", 0)) for r in results if r.error is None]
    return {
        "num_requests": len(results),
        "num_errors": len(results) - len(tokens),
        "output_tokens": sum(tokens),
        "server_tokens": counted.pop("emitted_tokens"),
        "iterations": counted.pop("iterations"),
        "seconds": seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "tokens_per_request": tokens,
        "server": counted,
    }


def cold_burst(
    config: ColdConfig, workload: str, round_index: int, arm: str, prompts: list[str]
) -> list[PhaseResult]:
    """One burst of `arm` on a server started for it, stopped afterwards."""
    from specdec.harness import ManagedServer

    server = ManagedServer(f"bench-{config.name}-cold", config.server_env)
    try:
        at_start = scrape_metrics(server.metrics_url)
        requests = sum(v for k, v in at_start.items() if k.startswith("specdec_requests_total"))
        rows = []
        plan = burst_plan(len(prompts), config.phases)
        for phase, indices in zip(config.phases, plan, strict=True):
            measured = measure_phase(server, config, phase, [prompts[i] for i in indices], arm)
            row = PhaseResult(
                workload,
                round_index,
                arm,
                phase.name,
                phase.streams,
                server_pid=server.process.pid,
                grpc_port=server.config.grpc_port,
                requests_at_start=requests,
                **measured,
            )
            print(
                f"{workload:<9} round {round_index} {arm:<9} {row.phase:<10} "
                f"{row.tokens_per_s:7.1f} tok/s ({row.output_tokens} tokens in "
                f"{row.seconds:.1f} s, {row.num_errors} errors, server pid {row.server_pid}; "
                f"{row.iterations:.0f} iterations{drafted(row.server)})",
                flush=True,
            )
            rows.append(row)
        return rows
    finally:
        server.stop()


def drafted(counted: dict[str, float]) -> str:
    """Each proposer's accepted / proposed draft tokens, where it proposed any."""
    active = tuple(name for name in PROPOSER_NAMES if counted.get(f"{name}_draft_tokens"))
    return "".join(f", {tally}" for tally in accepted_of_drafted(counted, active))


def ratio_rows(results: list[PhaseResult], arms: tuple[str, ...]) -> list[dict]:
    """Per workload, phase and round: each arm's tokens/s and each arm over k0; with k0-again
    among the arms, also each other arm over both k = 0 servers (the geometric mean of k0's
    and k0-again's tokens/s: a baseline of two servers, which one server's luck moves less);
    with several rounds also a row "mean": the tokens/s' mean and each ratio's mean."""
    rate = {(r.workload, r.phase, r.round, r.arm): r.tokens_per_s for r in results}
    others = [arm for arm in arms if arm != BASELINE]
    paired = [arm for arm in others if arm != AGAIN] if AGAIN in arms else []
    rows = []
    for workload, phase in dict.fromkeys((r.workload, r.phase) for r in results):
        rounds = sorted({r.round for r in results if (r.workload, r.phase) == (workload, phase)})
        mine = []
        for n in rounds:
            row: dict = {"workload": workload, "phase": phase, "round": n}
            row |= {f"{arm} tok/s": rate[(workload, phase, n, arm)] for arm in arms}
            k0 = row[f"{BASELINE} tok/s"]
            row |= {f"{a}/{BASELINE}": row[f"{a} tok/s"] / k0 if k0 else None for a in others}
            both = math.sqrt(k0 * row[f"{AGAIN} tok/s"]) if paired else 0.0
            row |= {f"{a}/{PAIR}": row[f"{a} tok/s"] / both if both else None for a in paired}
            mine.append(row)
        rows += mine
        if len(mine) > 1:
            keys = [key for key in mine[0] if key not in ("workload", "phase", "round")]
            mean = {k: _mean([row[k] for row in mine]) for k in keys}
            rows.append({"workload": workload, "phase": phase, "round": "mean", **mean})
    return rows


def _mean(values: list[float | None]) -> float | None:
    return None if None in values else statistics.fmean(v for v in values if v is not None)


def noise_floor(rows: list[dict]) -> float | None:
    """The lowest k0-again / k0 of any round: an arm equal to k0 can read this low."""
    key = f"{AGAIN}/{BASELINE}"
    ratios = [row[key] for row in rows if row["round"] != "mean" and row.get(key) is not None]
    return min(ratios) if ratios else None


def table(rows: list[dict]) -> str:
    """The ratio rows as a markdown table."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [_cell(key, row[key]) for key in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("tok/s"):
        return f"{value:.1f}"
    return f"{value:.2f}x" if "/" in key else str(value)


def run(config: ColdConfig) -> list[dict]:
    """Every workload's bursts, round by round; writes <out_dir>/<name>-cold.json and .csv
    and prints the ratio table. Returns the ratio rows."""
    config.validate()
    results: list[PhaseResult] = []
    render = chat_template()
    parts: Iterator[int] = itertools.count()  # a unique workload's: one per burst
    size = sum(phase.num_requests for phase in config.phases)
    for w, name in enumerate(config.workloads):
        workload = read_workload(name)
        for n in range(config.rounds):
            for arm in arm_order(config.arms, w + n):
                prompts = burst_prompts(workload, next(parts), size, render)
                results += cold_burst(config, name, n, arm, prompts)
    rows = ratio_rows(results, config.arms)
    meta = {
        "max_tokens": config.max_tokens,
        "rounds": config.rounds,
        "arms": list(config.arms),
        "phases": [asdict(phase) for phase in config.phases],
        "model": config.model,
        "server_env": config.server_env,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "noise_floor": noise_floor(rows),
    }
    config.out_dir.mkdir(parents=True, exist_ok=True)
    base = config.out_dir / f"{config.name}-cold"
    bursts = [asdict(r) for r in results]
    document = {"meta": meta, "bursts": bursts, "ratios": rows}
    base.with_suffix(".json").write_text(json.dumps(document, indent=2))
    with base.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(table(rows))
    print(f"noise floor (lowest k0-again / k0 of a round): {meta['noise_floor']}")
    print(f"wrote {base}.json, .csv")
    return rows
