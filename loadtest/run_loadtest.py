"""`make loadtest`: Locust from 1 to 512 users, the modes compared within each stage.

    .venv/bin/python loadtest/run_loadtest.py [--modes k0,adaptive,k0-again]
        [--stages 1,4,16,64,128,256,512] [--window-seconds 20] [--max-tokens 64] [--smoke]
        [--workload chat|grounded|rewrite|shared-prefix|multi-turn|agentic|structured]

Starts a server of its own (or uses --url and --metrics-url) and one Locust run on it
(loadtest/locustfile.py, GrpcUser) by a plan (loadtest/schedule.py): at each stage of users
the modes take turns in windows, mirrored (k0 adaptive k0-again k0-again adaptive k0), so
that they meet the machine at the same times; k0-again is k = 0 under a second name, and
its ratio to k0 is the run's noise floor. Meanwhile it samples the server's counters twice
a second. Each stage and mode is measured over the intervals in which the server ran only
its requests (see schedule.py), with the server's specdec_emitted_tokens_total and the
tokens the users received side by side. Writes results/loadtest/: summary.json, .csv, .md
(the table) and .png, the plan, the records, the metrics samples, Locust's CSV and HTML.
Stages that lower the users (e.g. --stages 64,512,64,512) need --model speculative_decoding:
Locust cancels the streams of the users it stops, and only the BLS itself hears that (an
ensemble step runs on), so only then do the stopped users' requests leave the batch.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import MODES, WORKLOAD_NAMES, finish_axes, parse_env, unknown_modes
from schedule import STAGES, build_plan, segments_of, set_pure_intervals
from schedule import summarize_segments as summarize
from specdec.client import scrape_metrics, wait_until_idle
from specdec.paths import PROJECT_ROOT

LOCUSTFILE = PROJECT_ROOT / "loadtest" / "locustfile.py"
SMOKE_STAGES = [1, 2]
DEFAULT_MODES = ["k0", "adaptive", "k0-again"]  # k0-again: the noise floor


@dataclass
class LoadtestConfig:
    out_dir: Path = PROJECT_ROOT / "results" / "loadtest"
    url: str | None = None  # None: a server of our own
    metrics_url: str | None = None  # with url: its metrics endpoint
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    stages: list[int] = field(default_factory=lambda: list(STAGES))
    window_seconds: float = 20.0  # up to 16 users; longer beyond (schedule.window_seconds)
    max_tokens: int = 64
    model: str = "ensemble"  # or speculative_decoding: the BLS itself, which hears cancels
    workload: str = "chat"  # the prompts Locust sends (loadtest/common.py WORKLOAD_NAMES)
    server_env: dict[str, str] = field(default_factory=dict)


class MetricsSampler:
    """specdec_emitted_tokens_total, specdec_queued_requests and specdec_running_batch_size
    every `period` s in a thread of its own, as (unix s, value)."""

    NAMES = {
        "emitted": "specdec_emitted_tokens_total",
        "queued": "specdec_queued_requests",
        "running": "specdec_running_batch_size",
    }

    def __init__(self, url: str, period: float = 0.5) -> None:
        self.url, self.period = url, period
        self.samples: dict[str, list[tuple[float, float]]] = {k: [] for k in self.NAMES}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            before = time.time()
            values = scrape_metrics(self.url)
            now = (before + time.time()) / 2  # the scrape's midpoint
            for key, name in self.NAMES.items():
                self.samples[key].append((now, values.get(name, 0.0)))
            self.stopping.wait(max(0.0, self.period - (time.time() - before)))

    def stop(self) -> dict[str, list[tuple[float, float]]]:
        self.stopping.set()
        self.thread.join()
        return self.samples


def run_locust(config: LoadtestConfig, url: str, plan: Path, records: Path) -> float:
    """Locust by the plan; returns the share of one core its process used."""
    command = [
        str(Path(sys.executable).parent / "locust"),
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        url,
        "--plan",
        str(plan),
        "--max-tokens",
        str(config.max_tokens),
        "--model",
        config.model,
        "--workload",
        config.workload,
        "--records",
        str(records),
        "--csv",
        str(config.out_dir / "locust"),
        "--html",
        str(config.out_dir / "locust.html"),
        "--only-summary",
        "--exit-code-on-error",
        "0",
    ]
    start = time.time()
    process = subprocess.Popen(command, cwd=PROJECT_ROOT)
    cpu = 0.0
    while process.poll() is None:
        cpu = process_cpu_seconds(process.pid) or cpu
        time.sleep(1.0)
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return cpu / max(time.time() - start, 1e-9)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (Linux /proc), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def add_ratios(rows: list[dict]) -> None:
    """Each row's server tokens/s against k0 of its stage (k0-again: the noise floor)."""
    base = {r["users"]: r["server_tokens_per_s"] for r in rows if r["mode"] == "k0"}
    for row in rows:
        k0 = base.get(row["users"])
        value = row["server_tokens_per_s"]
        row["over_k0"] = value / k0 if k0 and value is not None else None


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table(rows: list[dict]) -> str:
    """Markdown, one line per stage and mode."""
    lines = [
        "| users | mode | server tok/s | client tok/s | client / server | vs k0 | "
        "TTFT p50 / p99 s (client) | TTFT p50 s (server) | inter-chunk p50 / p99 ms | "
        "queue mean / max | counted s | requests | failed | refused |",
        "|---" * 14 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['users']} | {r['mode']} | {fmt(r['server_tokens_per_s'])} | "
            f"{fmt(r['client_tokens_per_s'])} | {fmt(r['client_over_server'], 3)} | "
            f"{fmt(r['over_k0'], 2, 'x')} | "
            f"{fmt(r['ttft_p50_s'], 2)} / {fmt(r['ttft_p99_s'], 2)} | "
            f"{fmt(r['server_ttft_p50_s'], 2)} | "
            f"{fmt(ms(r['inter_chunk_p50_s']), 0)} / {fmt(ms(r['inter_chunk_p99_s']), 0)} | "
            f"{fmt(r['queue_mean'], 0)} / {fmt(r['queue_max'], 0)} | {r['counted_s']:.0f} | "
            f"{r['requests']} | {r['failures']} | {refusals(r)} |"
        )
    return "\n".join(lines)


def validity_line(rows: list[dict]) -> str:
    """The guided answers (structured) valid / invalid / cut by users and mode, as a line
    of the summary; '' without any."""
    counted = [r for r in rows if r.get("valid_outputs") is not None]
    if not counted:
        return ""
    counts = ", ".join(
        f"{r['users']} {r['mode']} {r['valid_outputs']}/{r['invalid_outputs']}/{r['cut_outputs']}"
        for r in counted
    )
    return f"Structured answers valid/invalid/cut by users and mode: {counts}\n"


def refusals(row: dict) -> str:
    """How many, and how fast the refusal came back (p99)."""
    if not row["refusals"]:
        return "0"
    return f"{row['refusals']} (p99 {1000 * row['refusal_p99_s']:.0f} ms)"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def noise_floor(rows: list[dict]) -> dict[int, float]:
    """Per stage, k0-again's server tokens/s over k0's."""
    return {r["users"]: r["over_k0"] for r in rows if r["mode"] == "k0-again" and r["over_k0"]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode and r["server_tokens_per_s"] is not None]
        users = [r["users"] for r in mine]
        (line,) = left.plot(
            users, [r["server_tokens_per_s"] for r in mine], marker="o", label=f"{mode} server"
        )
        color = line.get_color()
        left.plot(
            users,
            [r["client_tokens_per_s"] for r in mine],
            marker="x",
            linestyle=":",
            color=color,
            label=f"{mode} Locust",
        )
        timed = [r for r in rows if r["mode"] == mode and r["ttft_p50_s"] is not None]
        right.plot(
            [r["users"] for r in timed],
            [r["ttft_p50_s"] for r in timed],
            marker="o",
            color=color,
            label=f"{mode} p50",
        )
        right.plot(
            [r["users"] for r in timed],
            [r["ttft_p99_s"] for r in timed],
            marker="x",
            linestyle="--",
            color=color,
            label=f"{mode} p99",
        )
    right.set_yscale("log")
    finish_axes(((left, "output tokens/s"), (right, "time to first token (s)")), "users")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(config: LoadtestConfig, rows: list[dict], meta: dict) -> None:
    out = config.out_dir
    (out / "summary.json").write_text(json.dumps({"meta": meta, "stages": rows}, indent=2))
    with (out / "summary.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    floor = ", ".join(f"{u}: {x:.2f}x" for u, x in noise_floor(rows).items())
    (out / "summary.md").write_text(
        f"{table(rows)}\n\nNoise floor (k0-again / k0, server tok/s) by users: {floor or '-'}\n"
        f"Locust process: {meta['locust_cpu_share']:.0%} of a core.\n{validity_line(rows)}"
    )
    plot(rows, out / "summary.png")


def run(config: LoadtestConfig) -> list[dict]:
    unknown = unknown_modes(config.modes)
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {list(MODES)}")
    config.out_dir.mkdir(parents=True, exist_ok=True)
    plan = build_plan(config.stages, config.modes, config.window_seconds)
    plan_path = config.out_dir / "plan.json"
    plan_path.write_text(json.dumps({"windows": [asdict(w) for w in plan]}, indent=1))
    records_path = config.out_dir / "records.jsonl"
    records_path.unlink(missing_ok=True)
    server = None
    if config.url is None:
        from specdec.harness import ManagedServer

        server = ManagedServer("loadtest", config.server_env)
    try:
        url = config.url or server.url
        metrics_url = config.metrics_url or server.metrics_url
        wait_until_idle(metrics_url)
        sampler = MetricsSampler(metrics_url)
        started = time.time()
        try:
            cpu_share = run_locust(config, url, plan_path, records_path)
        finally:
            metrics = sampler.stop()
    finally:
        if server is not None:
            server.stop()
    (config.out_dir / "metrics.json").write_text(json.dumps(metrics))
    records = load_records(records_path)
    segments = segments_of(plan, records)
    set_pure_intervals(segments, cancels_heard=config.model != "ensemble")
    rows = summarize(segments, records, metrics)
    add_ratios(rows)
    meta = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "minutes": round((time.time() - started) / 60, 1),
        "max_tokens": config.max_tokens,
        "model": config.model,
        "workload": config.workload,
        "window_seconds": config.window_seconds,
        "modes": config.modes,
        "stages": config.stages,
        "server_env": config.server_env,
        "locust_cpu_share": cpu_share,
        "noise_floor": noise_floor(rows),
    }
    write_outputs(config, rows, meta)
    print(table(rows))
    print((config.out_dir / "summary.md").read_text().split("\n\n", 1)[1], end="")
    print(f"wrote {config.out_dir}/summary.json, .csv, .md, .png and Locust's CSV/HTML")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument("--metrics-url", default=None, help="with --url: http://h:8002/metrics")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)), help="users per stage")
    parser.add_argument(
        "--window-seconds", type=float, default=20.0, help="one window, up to 16 users"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="ensemble", help="or speculative_decoding")
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOAD_NAMES))
    parser.add_argument("--smoke", action="store_true", help="CI: 1 and 2 users, 3 s windows")
    parser.add_argument("--out-dir", type=Path, default=LoadtestConfig.out_dir)
    parser.add_argument("--server-env", default="", help="own server, e.g. NUM_SLOTS=32")
    args = parser.parse_args()
    config = LoadtestConfig(
        out_dir=args.out_dir,
        url=args.url,
        metrics_url=args.metrics_url,
        modes=args.modes.split(","),
        stages=[int(u) for u in args.stages.split(",")],
        window_seconds=args.window_seconds,
        max_tokens=args.max_tokens,
        model=args.model,
        workload=args.workload,
        server_env=parse_env(args.server_env),
    )
    if args.smoke:
        config.stages, config.window_seconds, config.max_tokens = SMOKE_STAGES, 3.0, 16
    run(config)


if __name__ == "__main__":
    main()
