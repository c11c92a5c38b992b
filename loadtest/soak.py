"""Soak: bounded load for a fixed time; fails on any failed request or on memory growth.

    .venv/bin/python loadtest/soak.py --duration 600 --concurrency 8     # what `make soak` runs

`concurrency` workers, each on its own gRPC stream, send streamed requests back to back until
the time is up, cycling through greedy adaptive, fixed k = 2, seeded sampling and stop-word
requests over the shipped prompts. Every few seconds it samples the resident memory of the
server and its stub processes (own server, or --pid of a running tritonserver). Growth is
the largest sample after the warm-up over the last sample of the warm-up. Writes
results/<name>.json and exits 1 on any failure or on growth of `--max-growth` or more.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import WORKLOADS, load_prompts
from specdec.client import StreamingClient
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT
from specdec.processes import tree_resident_bytes

REQUEST_MIX = [
    dict(),  # greedy, adaptive k
    dict(num_draft_tokens=2),
    dict(temperature=0.8, top_p=0.95, seed=11),
    dict(stop_words=["\n\n"]),
]


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 8
    max_tokens: int = 64
    warmup_s: float = 120.0
    sample_every_s: float = 5.0
    max_growth: float = 0.10
    url: str | None = None  # None: start a server of our own
    pid: int | None = None  # tritonserver's, to sample memory of a server we did not start
    model: str = "ensemble"
    name: str = "soak"
    out_dir: Path = PROJECT_ROOT / "results"


@dataclass
class SoakResult:
    requests: int = 0
    failures: int = 0
    output_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # the first few messages
    memory: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)
    warmup_bytes: int | None = None
    peak_after_warmup_bytes: int | None = None
    growth: float | None = None

    def passed(self, max_growth: float) -> bool:
        """No failure, and memory within bounds where it was sampled."""
        return self.failures == 0 and (self.growth is None or self.growth < max_growth)


def worker(
    index: int,
    url: str,
    prompts: list[str],
    config: SoakConfig,
    deadline: float,
    result: SoakResult,
    lock: threading.Lock,
) -> None:
    with StreamingClient(url, config.model) as client:
        n = index
        while time.monotonic() < deadline:
            params = REQUEST_MIX[n % len(REQUEST_MIX)]
            generated = client.generate(
                prompts[n % len(prompts)],
                max_tokens=config.max_tokens,
                stream=True,
                return_num_output_tokens=True,
                **params,
            )
            with lock:
                result.requests += 1
                if generated.error is not None:
                    result.failures += 1
                    if len(result.errors) < 5:
                        result.errors.append(generated.error.message())
                else:
                    result.output_tokens += int(generated.metrics.get("num_output_tokens", 0))
            n += config.concurrency


def sample_memory(pid: int | None, result: SoakResult, config: SoakConfig, deadline: float):
    start = time.monotonic()
    while pid is not None and time.monotonic() < deadline:
        result.memory.append((round(time.monotonic() - start, 1), tree_resident_bytes(pid)))
        time.sleep(config.sample_every_s)


def judge_memory(result: SoakResult, config: SoakConfig) -> None:
    warm = [b for t, b in result.memory if t <= config.warmup_s]
    after = [b for t, b in result.memory if t > config.warmup_s]
    if warm and after:
        result.warmup_bytes = warm[-1]
        result.peak_after_warmup_bytes = max(after)
        result.growth = round(result.peak_after_warmup_bytes / result.warmup_bytes - 1, 4)


def run(config: SoakConfig) -> SoakResult:
    prompts = load_prompts(WORKLOADS["chat"])
    server = ManagedServer(f"soak-{config.name}") if config.url is None else None
    url = config.url or server.url
    pid = server.process.pid if server is not None else config.pid
    result, lock = SoakResult(), threading.Lock()
    try:
        deadline = time.monotonic() + config.duration_s
        threads = [
            threading.Thread(
                target=worker,
                args=(i, url, prompts, config, deadline, result, lock),
            )
            for i in range(config.concurrency)
        ]
        threads.append(threading.Thread(target=sample_memory, args=(pid, result, config, deadline)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        if server is not None:
            server.stop()
    judge_memory(result, config)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {**asdict(config), "out_dir": str(config.out_dir)},
        **asdict(result),
        "passed": result.passed(config.max_growth),
    }
    (config.out_dir / f"{config.name}.json").write_text(json.dumps(report, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before judging")
    parser.add_argument("--max-growth", type=float, default=0.10)
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument("--pid", type=int, default=None, help="tritonserver pid (with --url)")
    parser.add_argument("--name", default="soak", help="<out-dir>/<name>.json")
    parser.add_argument("--out-dir", type=Path, default=PROJECT_ROOT / "results")
    args = parser.parse_args()
    config = SoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup,
        max_growth=args.max_growth,
        url=args.url,
        pid=args.pid,
        name=args.name,
        out_dir=args.out_dir,
    )
    result = run(config)
    growth = "not sampled" if result.growth is None else f"{100 * result.growth:+.1f}%"
    print(
        f"{result.requests} requests, {result.failures} failed, {result.output_tokens} tokens; "
        f"memory after warm-up {growth} (limit {100 * config.max_growth:.0f}%)"
    )
    for message in result.errors:
        print(f"  error: {message}")
    sys.exit(0 if result.passed(config.max_growth) else 1)


if __name__ == "__main__":
    main()
