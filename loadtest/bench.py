"""Speculative against plain decoding, side by side, on one running server.

    .venv/bin/python loadtest/bench.py --modes k0,k4 --concurrency 1 --max-tokens 128

For each concurrency level, the modes take turns on the same server in two windows each,
in mirrored order (k0 k2 k4 adaptive adaptive k4 k2 k0, reversed at the next level), so
that drift in the machine's speed over a level hits every mode alike: on these shared
machines the same target call measured 10% apart a few minutes later. In a window,
`concurrency` workers, each on its own gRPC stream, send streamed greedy requests back to
back for half of `--level-seconds`. Output tokens/s is the server's emitted-token counter
over the windows, in which every stream is busy (the requests under way at a window's end
then finish; counting whole requests instead would mix in a tail at lower concurrency).
Per level and mode it also records p50/p99 request latency, time to first token and
inter-chunk latency, and the acceptance rate. Writes results/<name>.json, .csv and .png
and prints tokens/s ratios against k = 0. Without --url it starts its own server.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from report import finish_axes, percentile
from specdec.client import StreamingClient, scrape_metrics

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# k0-again is k = 0 under a second name: `--modes k0,k0-again` measures the noise floor.
MODES: dict[str, int | None] = {
    "k0": 0,
    "k2": 2,
    "k4": 4,
    "k8": 8,
    "adaptive": None,
    "k0-again": 0,
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
    prompts: Path = PROJECT_ROOT / "loadtest" / "prompts.jsonl"
    out_dir: Path = PROJECT_ROOT / "results"
    name: str = "bench"
    server_env: dict[str, str] = field(default_factory=dict)


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    num_requests: int
    num_errors: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float  # while all `concurrency` streams were busy (server counter)
    window_tokens_per_s: list[float]  # each window's own figure: the spread drift leaves
    completed_tokens_per_s: float  # tokens of completed requests / wall time, tail included
    acceptance_rate: float
    draft_tokens_per_output_token: float  # how much the mode speculated
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    inter_chunk_p50_s: float
    inter_chunk_p99_s: float


def load_prompts(path: Path) -> list[str]:
    """Chat-formatted prompts from a JSONL file of {"category", "prompt"} lines."""
    from specdec.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(PROJECT_ROOT / "models" / "smollm2-135m-instruct")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [tokenizer.apply_chat_template(item["prompt"]) for item in lines]


def emitted_tokens(metrics_url: str | None) -> float:
    if metrics_url is None:
        return 0.0
    return scrape_metrics(metrics_url).get("specdec_emitted_tokens_total", 0.0)


@dataclass
class Window:
    """One mode's stretch of sustained load: its requests and the server's count of tokens."""

    results: list
    tokens: float  # emitted while every stream was busy (server counter)
    seconds: float  # that window
    wall: float  # until the last request under way at its end finished


def run_window(
    url: str, mode: str, concurrency: int, prompts: list[str], config: BenchConfig, seconds: float
) -> Window:
    """`concurrency` streams send requests back to back for `seconds`; requests under way at
    the end finish (their latencies count), but only the tokens emitted while every stream
    was busy count towards throughput."""
    results, lock = [], threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker(index: int) -> None:
        with StreamingClient(url, config.model) as client:
            for r in itertools.count():
                if r and time.perf_counter() >= deadline:  # every stream sends at least one
                    return
                result = client.generate(
                    prompts[(index + r * concurrency) % len(prompts)],
                    max_tokens=config.max_tokens,
                    stream=True,
                    num_draft_tokens=MODES[mode],
                    return_perf_metrics=True,
                    return_num_output_tokens=True,
                    exclude_input_in_output=True,
                )
                with lock:
                    results.append(result)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    start, counted_before = time.perf_counter(), emitted_tokens(config.metrics_url)
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, deadline - time.perf_counter()))
    tokens = emitted_tokens(config.metrics_url) - counted_before
    window = time.perf_counter() - start
    for thread in threads:
        thread.join()
    return Window(results, tokens, window, time.perf_counter() - start)


def summarize(mode: str, concurrency: int, windows: list[Window], counted: bool) -> LevelResult:
    """One mode at one level, over all its windows (`counted`: the server counted tokens)."""
    results = [r for w in windows for r in w.results]
    wall = sum(w.wall for w in windows)
    ok = [r for r in results if r.error is None]
    tokens = sum(int(r.metrics.get("num_output_tokens", 0)) for r in ok)
    drafted = sum(r.metrics.get("total_draft_tokens", 0) for r in ok)
    accepted = sum(r.metrics.get("total_accepted_draft_tokens", 0) for r in ok)
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r.chunk_times)]
    latencies = [r.elapsed for r in ok]
    ttfts = [r.time_to_first_token for r in ok if r.time_to_first_token is not None]
    if counted:
        per_window = [w.tokens / w.seconds for w in windows]
        tokens_per_s = sum(w.tokens for w in windows) / sum(w.seconds for w in windows)
    else:
        per_window = [
            sum(int(r.metrics.get("num_output_tokens", 0)) for r in w.results if r.error is None)
            / w.wall
            for w in windows
        ]
        tokens_per_s = tokens / wall
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        output_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens_per_s,
        window_tokens_per_s=[round(x, 2) for x in per_window],
        completed_tokens_per_s=tokens / wall,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        draft_tokens_per_output_token=drafted / tokens if tokens else 0.0,
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        inter_chunk_p50_s=percentile(gaps, 50),
        inter_chunk_p99_s=percentile(gaps, 99),
    )


def window_schedule(modes: list[str], level_index: int) -> list[str]:
    """Each mode twice, in mirrored order (A B C D D C B A), the order itself alternating
    from level to level: drift that is linear over a level hits every mode alike."""
    order = modes if level_index % 2 == 0 else modes[::-1]
    return order + order[::-1]


def ratio_table(levels: list[LevelResult], modes: list[str]) -> str:
    by_key = {(r.mode, r.concurrency): r for r in levels}
    concurrencies = sorted({r.concurrency for r in levels})
    header = "| concurrency | " + " | ".join(f"{m} tok/s" for m in modes)
    if "k0" in modes:
        header += " | " + " | ".join(f"{m}/k0" for m in modes if m != "k0")
    lines = [header + " |", "|" + "---|" * (header.count("|"))]
    for c in concurrencies:
        row = [f"{by_key[(m, c)].tokens_per_s:.1f}" for m in modes]
        if "k0" in modes:
            base = by_key[("k0", c)].tokens_per_s
            row += [f"{by_key[(m, c)].tokens_per_s / base:.2f}x" for m in modes if m != "k0"]
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(levels: list[LevelResult], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in modes:
        rows = sorted((r for r in levels if r.mode == mode), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rows]
        left.plot(xs, [r.tokens_per_s for r in rows], marker="o", label=mode)
        right.plot(xs, [r.latency_p99_s for r in rows], marker="o", label=mode)
    finish_axes(((left, "output tokens/s"), (right, "p99 request latency (s)")), "concurrency")
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


def run(config: BenchConfig) -> list[LevelResult]:
    prompts = load_prompts(config.prompts)
    server = None
    if config.url is None:
        from specdec.launch import ManagedServer

        server = ManagedServer(f"bench-{config.name}", config.server_env)
        config.metrics_url = server.metrics_url
    url = config.url or server.url
    try:
        warm_up = BenchConfig(modes=[], concurrency=[], max_tokens=8, level_seconds=0.0)
        warm_up.model = config.model
        run_window(url, config.modes[0], 1, prompts[:1], warm_up, 0.0)
        levels = []
        for i, concurrency in enumerate(config.concurrency):
            windows: dict[str, list[Window]] = {mode: [] for mode in config.modes}
            schedule = window_schedule(config.modes, i)
            for mode in schedule:
                seconds = config.level_seconds / schedule.count(mode)
                windows[mode].append(run_window(url, mode, concurrency, prompts, config, seconds))
            for mode in config.modes:
                level = summarize(mode, concurrency, windows[mode], config.metrics_url is not None)
                levels.append(level)
                print(
                    f"c={concurrency:<3} {mode:<9} {level.tokens_per_s:7.1f} tok/s "
                    f"(windows {', '.join(f'{x:.1f}' for x in level.window_tokens_per_s)})  "
                    f"p99 latency {level.latency_p99_s:6.2f} s  "
                    f"acceptance {level.acceptance_rate:.2f}  "
                    f"drafted/token {level.draft_tokens_per_output_token:.2f}  "
                    f"errors {level.num_errors}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()
    meta = {
        "max_tokens": config.max_tokens,
        "level_seconds": config.level_seconds,
        "model": config.model,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "server_env": config.server_env,
    }
    base = write_outputs(levels, config, meta)
    print(ratio_table(levels, config.modes))
    print(f"wrote {base}.json, .csv, .png")
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="k0,k2,k4,adaptive", help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--level-seconds", type=float, default=40.0, help="sustained load per level and mode"
    )
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument("--metrics-url", default=None, help="with --url: http://host:8002/metrics")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--name", default="bench", help="<out-dir>/<name>.{json,csv,png}")
    parser.add_argument("--out-dir", type=Path, default=PROJECT_ROOT / "results")
    parser.add_argument(
        "--server-env",
        default="",
        help="for the own server, e.g. DRAFT_CHECKPOINT=models/x,NUM_SLOTS=64",
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.server_env.split(",") if item)
    run(
        BenchConfig(
            modes=args.modes.split(","),
            concurrency=[int(c) for c in args.concurrency.split(",")],
            max_tokens=args.max_tokens,
            level_seconds=args.level_seconds,
            url=args.url,
            metrics_url=args.metrics_url,
            model=args.model,
            name=args.name,
            out_dir=args.out_dir,
            server_env=env,
        )
    )


if __name__ == "__main__":
    main()
