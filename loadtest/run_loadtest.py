"""`make loadtest`: the Locust ramp once per mode (k = 0, adaptive, k = 0 again), one server.

    .venv/bin/python loadtest/run_loadtest.py [--runs k0,adaptive,k0-again] [--smoke]
        [--stage-seconds 45] [--max-users 256]

Starts a server of its own (or uses --url) and runs `locust --headless --ramp` against it
once per run, one after the other, each with Locust's CSV and HTML reports. A run is one of
bench.py's modes: k0 (num_draft_tokens = 0), k2, k4, adaptive (the server's choice), and
k0-again (k = 0 a second time: how far two ramps of one mode differ in one session). Writes
results/loadtest/summary.{json,csv,png}: per run and user stage, output tokens/s, p50/p99
time to first token and draft tokens per output token; prints them with each run's ratio to
k0.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import MODES
from report import finish_axes, percentile
from specdec.client import wait_until_idle

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = PROJECT_ROOT / "loadtest" / "locustfile.py"
# k = 0 first and last: a drift in the machine's speed over the session shows as k0-again
# against k0, next to adaptive against k0.
DEFAULT_RUNS = ["k0", "adaptive", "k0-again"]


@dataclass
class LoadtestConfig:
    out_dir: Path = PROJECT_ROOT / "results" / "loadtest"
    url: str | None = None
    metrics_url: str | None = None  # with url: its metrics endpoint
    runs: list[str] = field(default_factory=lambda: list(DEFAULT_RUNS))
    smoke: bool = False
    stage_seconds: float = 45.0
    max_users: int = 256
    max_tokens: int = 128


def run_locust(config: LoadtestConfig, url: str, name: str, k: int) -> Path:
    records = config.out_dir / f"{name}.records.jsonl"
    records.unlink(missing_ok=True)
    command = [
        str(Path(sys.executable).parent / "locust"),
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        url,
        "--smoke" if config.smoke else "--ramp",
        "--stage-seconds",
        str(config.stage_seconds),
        "--max-users",
        str(config.max_users),
        "--max-tokens",
        str(config.max_tokens),
        "--num-draft-tokens",
        str(k),
        "--records",
        str(records),
        "--csv",
        str(config.out_dir / name),
        "--html",
        str(config.out_dir / f"{name}.html"),
        "--only-summary",
        "--exit-code-on-error",
        "0",
    ]
    subprocess.run(command, check=True, cwd=PROJECT_ROOT)
    return records


def summarize(records: Path) -> list[dict]:
    """Per user count: requests, failures, output tokens/s, p50/p99 time to first token, and
    draft tokens proposed per output token."""
    rows = [json.loads(line) for line in records.read_text().splitlines() if line]
    stages = []
    for users in sorted({r["users"] for r in rows}):
        stage = [r for r in rows if r["users"] == users]
        ok = [r for r in stage if r["outcome"] == "ok"]
        start = min(r["t"] - r["elapsed"] for r in stage)
        end = max(r["t"] for r in stage)
        ttfts = [r["ttft"] for r in ok if r.get("ttft") is not None]
        tokens = sum(r["tokens"] for r in ok)
        stages.append(
            {
                "users": users,
                "requests": len(stage),
                "failures": sum(r["outcome"] not in ("ok", "rejected") for r in stage),
                "rejected": sum(r["outcome"] == "rejected" for r in stage),
                "tokens_per_s": tokens / max(end - start, 1e-9),
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p99_s": percentile(ttfts, 99),
                "draft_tokens_per_output_token": sum(r.get("drafted", 0) for r in ok)
                / max(tokens, 1),
            }
        )
    return stages


def plot(summary: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, stages in summary.items():
        users = [s["users"] for s in stages]
        (line,) = left.plot(users, [s["tokens_per_s"] for s in stages], marker="o", label=name)
        color = line.get_color()  # one colour per run on both sides
        right.plot(
            users,
            [s["ttft_p50_s"] for s in stages],
            marker="o",
            color=color,
            label=f"{name} p50",
        )
        right.plot(
            users,
            [s["ttft_p99_s"] for s in stages],
            marker="x",
            linestyle="--",
            color=color,
            label=f"{name} p99",
        )
    finish_axes(((left, "output tokens/s"), (right, "time to first token (s)")), "users")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ratio_table(summary: dict[str, list[dict]]) -> str:
    """One row per user stage: each run's tokens/s (with its ratio to k0) and TTFT p50/p99."""
    runs = list(summary)
    header = "| users | " + " | ".join(
        f"{name} tok/s | {name} TTFT p50 / p99 s | {name} drafted/token" for name in runs
    )
    lines = [header + " | failed |", "|---" * (1 + 3 * len(runs)) + "|---|"]
    baseline = {s["users"]: s["tokens_per_s"] for s in summary.get("k0", [])}
    for users in sorted({s["users"] for stages in summary.values() for s in stages}):
        cells, failed = [], 0
        for name in runs:
            stage = next((s for s in summary[name] if s["users"] == users), None)
            if stage is None:
                cells += ["", "", ""]
                continue
            failed += stage["failures"]
            tokens = f"{stage['tokens_per_s']:.1f}"
            if name != "k0" and baseline.get(users):
                tokens += f" ({stage['tokens_per_s'] / baseline[users]:.2f}x)"
            cells += [
                tokens,
                f"{stage['ttft_p50_s']:.2f} / {stage['ttft_p99_s']:.2f}",
                f"{stage['draft_tokens_per_output_token']:.3f}",
            ]
        lines.append(f"| {users} | " + " | ".join(cells) + f" | {failed} |")
    return "\n".join(lines)


def run(config: LoadtestConfig) -> dict:
    unknown = [name for name in config.runs if name not in MODES]
    if unknown:
        raise SystemExit(f"--runs: unknown mode(s) {unknown}; known: {list(MODES)}")
    config.out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    if config.url is None:
        from specdec.launch import ManagedServer

        server = ManagedServer("loadtest")
    try:
        url = config.url or server.url
        metrics_url = config.metrics_url or server.metrics_url
        summary = {}
        for name in config.runs:
            # Streams Locust dropped at the end of a ramp finish on the server first: the next
            # run starts on an idle server.
            wait_until_idle(metrics_url)
            k = MODES[name].get("num_draft_tokens")  # a fixed k, or the server's choice
            summary[name] = summarize(run_locust(config, url, name, -1 if k is None else k))
    finally:
        if server is not None:
            server.stop()
    (config.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with (config.out_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", *next(iter(summary.values()))[0].keys()])
        for name, stages in summary.items():
            for stage in stages:
                writer.writerow([name, *stage.values()])
    plot(summary, config.out_dir / "summary.png")
    print(ratio_table(summary))
    print(f"wrote {config.out_dir}/summary.json, .csv, .png and Locust's CSV/HTML reports")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument(
        "--metrics-url", default=None, help="with --url, e.g. http://h:8002/metrics"
    )
    parser.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"ramps in this order, from {', '.join(MODES)}",
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--stage-seconds", type=float, default=45.0)
    parser.add_argument("--max-users", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out-dir", type=Path, default=LoadtestConfig.out_dir)
    args = parser.parse_args()
    run(
        LoadtestConfig(
            out_dir=args.out_dir,
            url=args.url,
            metrics_url=args.metrics_url,
            runs=args.runs.split(","),
            smoke=args.smoke,
            stage_seconds=args.stage_seconds,
            max_users=args.max_users,
            max_tokens=args.max_tokens,
        )
    )


if __name__ == "__main__":
    main()
