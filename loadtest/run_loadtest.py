"""`make loadtest`: the Locust ramp, speculative (adaptive) and k = 0, on one server.

    .venv/bin/python loadtest/run_loadtest.py [--smoke] [--stage-seconds 45]

Starts a server of its own (or uses --url), runs `locust --headless --ramp` twice against it,
first with the server's adaptive k, then with num_draft_tokens = 0, each with Locust's CSV
and HTML reports, and writes results/loadtest/summary.{json,csv,png}: per user stage, output
tokens/s and p50/p99 time to first token, for both runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from report import finish_axes, percentile
from specdec.client import wait_until_idle

PROJECT_ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = PROJECT_ROOT / "loadtest" / "locustfile.py"
RUNS = {"adaptive": -1, "k0": 0}


@dataclass
class LoadtestConfig:
    out_dir: Path = PROJECT_ROOT / "results" / "loadtest"
    url: str | None = None
    metrics_url: str | None = None  # with url: its metrics endpoint
    smoke: bool = False
    stage_seconds: float = 45.0
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
    """Per user count: requests, failures, output tokens/s, p50/p99 time to first token."""
    rows = [json.loads(line) for line in records.read_text().splitlines() if line]
    stages = []
    for users in sorted({r["users"] for r in rows}):
        stage = [r for r in rows if r["users"] == users]
        ok = [r for r in stage if r["outcome"] == "ok"]
        start = min(r["t"] - r["elapsed"] for r in stage)
        end = max(r["t"] for r in stage)
        ttfts = [r["ttft"] for r in ok if r.get("ttft") is not None]
        stages.append(
            {
                "users": users,
                "requests": len(stage),
                "failures": sum(r["outcome"] not in ("ok", "rejected") for r in stage),
                "rejected": sum(r["outcome"] == "rejected" for r in stage),
                "tokens_per_s": sum(r["tokens"] for r in ok) / max(end - start, 1e-9),
                "ttft_p50_s": percentile(ttfts, 50),
                "ttft_p99_s": percentile(ttfts, 99),
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
        left.plot(users, [s["tokens_per_s"] for s in stages], marker="o", label=name)
        right.plot(users, [s["ttft_p50_s"] for s in stages], marker="o", label=f"{name} p50")
        right.plot(
            users,
            [s["ttft_p99_s"] for s in stages],
            marker="x",
            linestyle="--",
            label=f"{name} p99",
        )
    finish_axes(((left, "output tokens/s"), (right, "time to first token (s)")), "users")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(config: LoadtestConfig) -> dict:
    config.out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    if config.url is None:
        from specdec.launch import ManagedServer

        server = ManagedServer("loadtest")
    try:
        url = config.url or server.url
        metrics_url = config.metrics_url or server.metrics_url
        summary = {}
        for name, k in RUNS.items():
            # Streams Locust dropped at the end of a ramp finish on the server first: the next
            # run starts on an idle server.
            wait_until_idle(metrics_url)
            summary[name] = summarize(run_locust(config, url, name, k))
    finally:
        if server is not None:
            server.stop()
    (config.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with (config.out_dir / "summary.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", *summary["k0"][0].keys()])
        for name, stages in summary.items():
            for stage in stages:
                writer.writerow([name, *stage.values()])
    plot(summary, config.out_dir / "summary.png")
    print(
        "| users | adaptive tok/s | k0 tok/s | adaptive TTFT p50/p99 s | k0 TTFT p50/p99 s "
        "| failures |\n|---|---|---|---|---|---|"
    )
    for a, b in zip(summary["adaptive"], summary["k0"], strict=False):
        print(
            f"| {a['users']} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
            f"{a['ttft_p50_s']:.2f} / {a['ttft_p99_s']:.2f} | "
            f"{b['ttft_p50_s']:.2f} / {b['ttft_p99_s']:.2f} | "
            f"{a['failures'] + b['failures']} |"
        )
    print(f"wrote {config.out_dir}/summary.json, .csv, .png and Locust's CSV/HTML reports")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument(
        "--metrics-url", default=None, help="with --url, e.g. http://h:8002/metrics"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--stage-seconds", type=float, default=45.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    run(
        LoadtestConfig(
            url=args.url,
            metrics_url=args.metrics_url,
            smoke=args.smoke,
            stage_seconds=args.stage_seconds,
            max_tokens=args.max_tokens,
        )
    )


if __name__ == "__main__":
    main()
