"""k = 0 on two servers that differ in one setting, at one concurrency, windows interleaved.

    .venv/bin/python loadtest/ab_servers.py --env-b RESPONSE_THREAD=true --concurrency 32 \
        --rounds 2 --server-env DTYPE=bfloat16

Server A runs with --server-env, server B with --env-b on top of it. Each round gives both
two windows in mirrored order (A B B A, then B A A B), as the bench does for its modes, so
that the machine's drift hits both alike; the figures are the servers' own counters:
tokens/s and where each iteration's time went (target call, responses, the outbox thread).
`make bench`'s bfloat16 / float32 comparison is this with --env-b DTYPE=float32. --url-a and
--url-b measure running servers instead (the test points both at one). Writes
<out-dir>/<name>.json and prints B / A per round.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from bench import (
    MODES,
    PROJECT_ROOT,
    WORKLOADS,
    BenchConfig,
    LevelResult,
    StaggeredLoad,
    load_prompts,
    run_level,
)
from report import parse_env
from specdec.client import generate

SIDES = {"a": MODES["k0"], "b": MODES["k0"]}  # both k = 0; the servers differ


def describe(r: LevelResult) -> str:
    return (
        f"{r.mode.upper()} {r.tokens_per_s:.1f} tok/s (ms/iteration: target "
        f"{r.target_ms_per_iteration:.1f} respond {r.respond_ms_per_iteration:.1f} outbox "
        f"{r.outbox_ms_per_iteration:.1f}; {r.tokens_per_iteration:.1f} tokens/iteration)"
    )


def measure(urls: dict, metrics: dict, args, config: BenchConfig) -> list[LevelResult]:
    prompts = load_prompts(WORKLOADS[args.workload])
    for url in urls.values():
        generate(prompts[0], url, config.model, max_tokens=8)  # warm-up
    levels = []
    for index in range(args.rounds):
        loads = {
            side: StaggeredLoad(urls[side], args.concurrency, prompts, config, metrics[side], SIDES)
            for side in SIDES
        }
        round_levels = run_level(args.workload, args.concurrency, list(SIDES), index, loads, config)
        a, b = (next(r for r in round_levels if r.mode == side) for side in SIDES)
        sides = "  ".join(describe(r) for r in (a, b))
        print(f"round {index}: B / A {b.tokens_per_s / a.tokens_per_s:.2f}x  {sides}", flush=True)
        levels += round_levels
    return levels


def run(args) -> dict:
    from specdec.harness import ManagedServer

    server_env, env_b = parse_env(args.server_env), parse_env(args.env_b)
    config = BenchConfig(
        modes=list(SIDES),
        concurrency=[args.concurrency],
        max_tokens=args.max_tokens,
        level_seconds=args.level_seconds,
    )
    servers = []
    try:
        if args.url_a:
            urls = {"a": args.url_a, "b": args.url_b}
            metrics = {"a": args.metrics_url_a, "b": args.metrics_url_b}
        else:
            servers = [
                ManagedServer(f"ab-{args.name}-a", server_env),
                ManagedServer(f"ab-{args.name}-b", {**server_env, **env_b}),
            ]
            urls = {side: s.url for side, s in zip(SIDES, servers, strict=True)}
            metrics = {side: s.metrics_url for side, s in zip(SIDES, servers, strict=True)}
        levels = measure(urls, metrics, args, config)
    finally:
        for server in servers:
            server.stop()
    totals = {side: sum(r.tokens_per_s for r in levels if r.mode == side) for side in SIDES}
    report = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "server_env": server_env,
        "env_b": env_b,
        "b_over_a": totals["b"] / totals["a"],
        "levels": [asdict(r) for r in levels],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(
        f"B / A over all rounds: {report['b_over_a']:.2f}x; wrote {args.out_dir / args.name}.json"
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-b", default="", help="what server B changes, e.g. DTYPE=float32")
    parser.add_argument("--server-env", default="", help="both servers, e.g. DTYPE=bfloat16")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--level-seconds", type=float, default=60.0, help="per side and round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workload", default="chat", choices=sorted(WORKLOADS))
    parser.add_argument("--url-a", default=None, help="gRPC host:port; default: own servers")
    parser.add_argument("--url-b", default=None)
    parser.add_argument("--metrics-url-a", default=None)
    parser.add_argument("--metrics-url-b", default=None)
    parser.add_argument("--name", default="ab")
    parser.add_argument("--out-dir", type=Path, default=PROJECT_ROOT / "results")
    args = parser.parse_args()
    if bool(args.url_a) != bool(args.url_b):
        parser.error("--url-a and --url-b go together")
    try:
        parse_env(args.server_env), parse_env(args.env_b)
    except ValueError as error:
        parser.error(str(error))
    run(args)


if __name__ == "__main__":
    main()
