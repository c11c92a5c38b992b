"""Speculative against plain decoding, side by side, on one running server, by workload.

    .venv/bin/python loadtest/bench.py --modes k0,ngram --workloads grounded --concurrency 1

Workloads: `chat` (loadtest/prompts.jsonl) and `grounded` (loadtest/prompts_grounded.jsonl:
answers that copy or rework text given in the prompt). Modes: k0 (no speculation), draft and
ngram (one proposer alone, k chosen by the server), adaptive (the server's choice of
proposer and k per row), k2/k4/k8 (the draft model at a fixed k), k0-again (the noise floor).

At each concurrency level the modes take turns in two windows each, in mirrored order (k0
k2 k4 adaptive adaptive k4 k2 k0, reversed at the next level), so that drift in the
machine's speed over a level hits every mode alike: on these shared machines the same
target call measured 10% apart a few minutes later. In a window, `concurrency` workers,
each on its own gRPC stream, send streamed greedy requests back to back, their ends
staggered as under real traffic (see StaggeredLoad). Output tokens/s is the server's
emitted-token counter over the windows' steady part. Per level and mode it also records
p50/p99 request latency, time to first token and inter-chunk latency, and the acceptance
rate. Writes results/<name>.json, .csv and .png and prints tokens/s ratios against k = 0.
Without --url it starts its own server.
"""

from __future__ import annotations

import argparse
import collections
import csv
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from report import finish_axes, parse_env, percentile
from specdec.client import GenerationResult, StreamingClient, generate, scrape_metrics
from specdec.paths import PROJECT_ROOT
from specdec.serving.metric_names import LOOP_PARTS, OUTBOX_SECONDS

# A mode's request inputs. k0-again is k = 0 under a second name: the noise floor.
MODES: dict[str, dict] = {
    "k0": {"num_draft_tokens": 0},
    "k2": {"num_draft_tokens": 2, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "k4": {"num_draft_tokens": 4, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "k8": {"num_draft_tokens": 8, "fixed_num_draft_tokens": True, "proposer": "draft_model"},
    "draft": {"proposer": "draft_model"},
    "ngram": {"proposer": "ngram"},
    "adaptive": {},
    "k0-again": {"num_draft_tokens": 0},
    "k0-float32": {"num_draft_tokens": 0},  # k = 0 on the float32 server (--float32-concurrency)
}
WORKLOADS = {
    "chat": PROJECT_ROOT / "loadtest" / "prompts.jsonl",
    "grounded": PROJECT_ROOT / "loadtest" / "prompts_grounded.jsonl",
}


@dataclass
class BenchConfig:
    modes: list[str]
    concurrency: list[int]
    max_tokens: int = 128
    level_seconds: float = 40.0  # of sustained load per level and mode, in two windows
    url: str | None = None  # None: start a server of our own
    metrics_url: str | None = None  # with url: its metrics endpoint (steady-state tokens/s)
    model: str = "ensemble"
    workloads: list[str] = field(default_factory=lambda: ["chat"])
    out_dir: Path = PROJECT_ROOT / "results"
    name: str = "bench"
    server_env: dict[str, str] = field(default_factory=dict)
    # Also k = 0 at this many streams on a second server of its own in float32, in windows
    # alternating with the first server's k = 0 (0: not measured).
    float32_concurrency: int = 0


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


def load_prompts(path: Path) -> list[str]:
    """Chat-formatted prompts from a JSONL file of {"category", "prompt"} lines."""
    from specdec.text.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [tokenizer.apply_chat_template(item["prompt"]) for item in lines]


# The loop's parts, and the outbox's time (inline: within respond; threaded: beside the loop).
TIMED_PARTS = (*LOOP_PARTS, "outbox")


def server_counters(metrics_url: str | None) -> dict[str, float]:
    """The server's emitted tokens, iterations and loop seconds by part; {} without metrics."""
    return {} if metrics_url is None else loop_counters(scrape_metrics(metrics_url))


def loop_counters(values: dict[str, float]) -> dict[str, float]:
    """Emitted tokens, iterations and loop seconds by part, from a scrape_metrics result."""
    counters = {
        "tokens": values.get("specdec_emitted_tokens_total", 0.0),
        "iterations": values.get("specdec_iterations_total", 0.0),
    }
    for part in LOOP_PARTS:
        counters[part] = values.get(f'specdec_loop_seconds_total{{part="{part}"}}', 0.0)
    counters["outbox"] = values.get(OUTBOX_SECONDS, 0.0)
    return counters


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before, by name: what loop_counters counted between two readings."""
    return {name: after[name] - before[name] for name in after}


def per_iteration(counted: dict[str, float]) -> dict[str, float]:
    """Tokens per iteration and ms per iteration by loop part, from loop_counters' deltas."""
    iterations = counted["iterations"]
    report = {"tokens_per_iteration": counted["tokens"] / iterations if iterations else 0.0}
    for part in TIMED_PARTS:
        ms = 1000 * counted[part] / iterations if iterations else 0.0
        report[f"{part}_ms_per_iteration"] = ms
    return report


@dataclass
class Request:
    """One request of a window, and what came back."""

    window: int  # the index of the window it belongs to
    result: GenerationResult | None = None  # once it has finished


@dataclass
class Window:
    """One mode's stretch of steady load, and the server's count of tokens emitted in it."""

    index: int
    mode: str
    start: float
    end: float
    tokens: float | None  # None: no metrics endpoint to count them
    counters: dict[str, float] = field(default_factory=dict)  # server_counters' deltas


class StaggeredLoad:
    """`concurrency` streams, each sending streamed greedy requests back to back in the mode
    of the current window, their ends staggered as under real traffic.

    A window starts every stream at once, stream i with a lead-in request (not reported) for
    (i + 1) / concurrency of `max_tokens`; from then on the streams' requests end at staggered
    times. Counting opens once every stream has had a token of the window's mode (the lead-
    ins' prefills are behind) and lasts `seconds`; then no new request leaves, and the window
    ends when the requests under way have finished, so that no request shares a batch with
    another mode's (they run on, at falling concurrency: their latencies are a little low).
    Earlier versions started every stream at once and counted from there: the window opened
    with one prefill of every prompt (a time to first token no user sees in steady traffic),
    and where it closed in the requests' common cycle moved a mode's figure (k = 0 against
    itself at 64 streams: 0.88x, against 0.98x staggered; one run each)."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        prompts: list[str],
        config: BenchConfig,
        metrics_url: str | None = None,
        modes: dict[str, dict] = MODES,
    ):
        """modes: the request parameters of each mode name its windows may run."""
        self.url, self.concurrency, self.prompts, self.config = url, concurrency, prompts, config
        self.metrics_url = metrics_url
        self.modes = modes
        self.requests: list[Request] = []  # lead-ins left out
        self.windows: list[Window] = []
        self.mode: str | None = None  # None: between windows, no request leaves
        self.busy = [False] * concurrency  # a request under way
        self.first_token = [False] * concurrency  # the stream has had a token this window
        self.stopping = False
        self.changed = threading.Condition()
        self.threads = [
            threading.Thread(target=self._stream, args=(i,), daemon=True)
            for i in range(concurrency)
        ]
        for thread in self.threads:
            thread.start()

    def _stream(self, index: int) -> None:
        def on_chunk(_chunk: str) -> None:
            self.first_token[index] = True

        # Each mode walks the same prompt sequence from its start (stream i: prompts i, i + c,
        # i + 2c, ...), so the modes are compared on the same prompts. A count shared by the
        # modes gave each mode other prompts: at one stream a 30 s window holds three or four
        # requests, and on the grounded prompts (some copy their whole input, some little)
        # prompt lookup alone read 3.42x and adaptive 2.07x in one run, while the same four
        # prompts through both gave 44.2 / 37.3 and 38.6 / 42.5 tok/s.
        sent = collections.Counter()  # mode -> requests this stream sent in it
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
                    max_tokens = self.config.max_tokens
                    if window != window_seen:  # the window's first request: a lead-in
                        window_seen = window
                        max_tokens = max(1, round(max_tokens * (index + 1) / self.concurrency))
                    else:
                        self.requests.append(request)
                prompt = (index + sent[mode] * self.concurrency) % len(self.prompts)
                sent[mode] += 1
                request.result = client.generate(
                    self.prompts[prompt],
                    max_tokens=max_tokens,
                    stream=True,
                    **self.modes[mode],
                    return_perf_metrics=True,
                    return_num_output_tokens=True,
                    exclude_input_in_output=True,
                    on_chunk=on_chunk,
                )

    def _wait(self, condition) -> None:
        with self.changed:
            while not self.changed.wait_for(condition, timeout=0.05):
                if not all(thread.is_alive() for thread in self.threads):
                    raise RuntimeError("a load stream died (the server stopped answering?)")

    def window(self, mode: str, seconds: float) -> Window:
        """`seconds` of steady load in `mode`, counted; returns once the load has drained."""
        with self.changed:
            self.first_token = [False] * self.concurrency
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
        window = Window(len(self.windows), mode, start, end, tokens, counted)
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
    workload: str, mode: str, concurrency: int, windows: list[Window], requests: list[Request]
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
    totals = {
        name: sum(w.counters.get(name, 0.0) for w in windows)
        for name in ("tokens", "iterations", *TIMED_PARTS)
    }
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
    )


def window_schedule(modes: list[str], level_index: int) -> list[str]:
    """Each mode twice, in mirrored order (A B C D D C B A), the order itself alternating
    from level to level: drift that is linear over a level hits every mode alike."""
    order = modes if level_index % 2 == 0 else modes[::-1]
    return order + order[::-1]


def ratio_table(levels: list[LevelResult], modes: list[str]) -> str:
    """tokens/s per workload, level and mode, and each mode's ratio to k0 of the same level."""
    by_key = {(r.workload, r.mode, r.concurrency): r for r in levels}
    header = "| workload | concurrency | " + " | ".join(f"{m} tok/s" for m in modes)
    if "k0" in modes:
        header += " | " + " | ".join(f"{m}/k0" for m in modes if m != "k0")
    lines = [header + " |", "|" + "---|" * (header.count("|") - 1)]
    for workload, c in sorted({(r.workload, r.concurrency) for r in levels}):
        row = [f"{by_key[(workload, m, c)].tokens_per_s:.1f}" for m in modes]
        if "k0" in modes:
            base = by_key[(workload, "k0", c)].tokens_per_s
            row += [
                f"{by_key[(workload, m, c)].tokens_per_s / base:.2f}x" for m in modes if m != "k0"
            ]
        lines.append(f"| {workload} | {c} | " + " | ".join(row) + " |")
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
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for axis, workload in zip(axes[0], workloads, strict=True):
        for mode in modes:
            rows = sorted(
                (r for r in levels if r.mode == mode and r.workload == workload),
                key=lambda r: r.concurrency,
            )
            axis.plot(
                [r.concurrency for r in rows],
                [r.tokens_per_s for r in rows],
                marker="o",
                label=mode,
            )
        axis.set_title(workload)
    finish_axes([(axis, "output tokens/s") for axis in axes[0]], "concurrent streams")
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


def run_level(
    workload: str, concurrency: int, modes: list[str], level_index: int, loads: dict, config
) -> list[LevelResult]:
    """One level: each mode's windows in mirrored order. `loads`: mode -> StaggeredLoad (a
    mode may run on a server of its own, as float32's k = 0 does)."""
    schedule = window_schedule(modes, level_index)
    seconds = config.level_seconds / schedule.count(modes[0])
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
            f"acceptance {level.acceptance_rate:.2f}  "
            f"drafted/token {level.draft_tokens_per_output_token:.2f}  "
            f"errors {level.num_errors}  "
            f"ms/iteration: target {level.target_ms_per_iteration:.1f} "
            f"draft {level.draft_ms_per_iteration:.1f} "
            f"respond {level.respond_ms_per_iteration:.1f} "
            f"(outbox {level.outbox_ms_per_iteration:.1f})  "
            f"tokens/iteration {level.tokens_per_iteration:.1f}",
            flush=True,
        )
    return results


def run(config: BenchConfig) -> list[LevelResult]:
    from specdec.harness import ManagedServer

    servers = []
    if config.url is None:
        servers.append(ManagedServer(f"bench-{config.name}", config.server_env))
        config.metrics_url = servers[0].metrics_url
    url = config.url or servers[0].url
    levels: list[LevelResult] = []
    try:
        for workload in config.workloads:
            prompts = load_prompts(WORKLOADS[workload])
            generate(prompts[0], url, config.model, max_tokens=8)  # warm-up
            for i, concurrency in enumerate(config.concurrency):
                load = StaggeredLoad(url, concurrency, prompts, config, config.metrics_url)
                loads = {mode: load for mode in config.modes}
                levels += run_level(workload, concurrency, config.modes, i, loads, config)
        if config.float32_concurrency:
            float32 = ManagedServer(
                f"bench-{config.name}-float32", {**config.server_env, "DTYPE": "float32"}
            )
            servers.append(float32)
            prompts = load_prompts(WORKLOADS[config.workloads[0]])
            generate(prompts[0], float32.url, config.model, max_tokens=8)
            c = config.float32_concurrency
            loads = {
                "k0": StaggeredLoad(url, c, prompts, config, config.metrics_url),
                "k0-float32": StaggeredLoad(float32.url, c, prompts, config, float32.metrics_url),
            }
            levels += run_level("dtype", c, ["k0", "k0-float32"], 0, loads, config)
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
    base = write_outputs(levels, config, meta)
    print(ratio_table([r for r in levels if r.workload != "dtype"], config.modes))
    print(f"noise floor (lowest k0-again / k0 of the run): {meta['noise_floor']}")
    dtype = {r.mode: r.tokens_per_s for r in levels if r.workload == "dtype"}
    if dtype:
        print(
            f"k = 0 at {config.float32_concurrency} streams, this server's dtype against "
            f"float32: {dtype['k0'] / dtype['k0-float32']:.2f}x "
            f"({dtype['k0']:.1f} / {dtype['k0-float32']:.1f} tok/s)"
        )
    print(f"wrote {base}.json, .csv, .png")
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="k0,adaptive,k0-again", help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument("--workloads", default="chat", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--level-seconds", type=float, default=40.0, help="sustained load per level and mode"
    )
    parser.add_argument(
        "--float32-concurrency",
        type=int,
        default=0,
        help="also k = 0 on a float32 server of its own at this many streams (0: no)",
    )
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
    args = parser.parse_args()
    env = parse_env(args.server_env)
    run(
        BenchConfig(
            modes=args.modes.split(","),
            concurrency=[int(c) for c in args.concurrency.split(",")],
            max_tokens=args.max_tokens,
            level_seconds=args.level_seconds,
            url=args.url,
            metrics_url=args.metrics_url,
            model=args.model,
            workloads=args.workloads.split(","),
            name=args.name,
            out_dir=args.out_dir,
            server_env=env,
            float32_concurrency=args.float32_concurrency,
        )
    )


if __name__ == "__main__":
    main()
