"""Where a mode's time goes: the same prompts through each mode in turn, one stream.

    .venv/bin/python loadtest/profile_modes.py [--workload grounded] [--num-prompts 4]
        [--modes ngram,adaptive,k0] [--rounds 2] [--url host:port --metrics-url URL]

`make bench` answers "how fast"; this answers "why". Every mode sends the same prompts one
after another (greedy, 128 tokens), so the modes differ only in how they decode; the rounds
repeat the modes in the same order to show the drift. Per mode and round it reports output
tokens/s as the client saw it, and from the server's counters (scraped before and after):
iterations, tokens per iteration, the draft tokens and accepted tokens of each proposer,
and the loop's milliseconds per iteration by part (`specdec_loop_seconds_total`:
cancellation check, draft call, target call, the rest of the step, responses). Without
--url it starts a server of its own (--server-env, default DTYPE=bfloat16). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import (
    MODES,
    TIMED_PARTS,
    WORKLOADS,
    accepted_of_drafted,
    counter_deltas,
    load_prompts,
    parse_env,
    unknown_modes,
)
from specdec.client import generate, scrape_metrics
from specdec.paths import PROJECT_ROOT


def profile(
    url: str, metrics_url: str, prompts: list[str], modes: list[str], rounds: int, max_tokens: int
) -> list[dict]:
    rows = []
    generate(prompts[0], url, max_tokens=8)  # warm-up
    for round_index in range(rounds):
        for mode in modes:
            before = scrape_metrics(metrics_url)
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:
                result = generate(
                    prompt,
                    url,
                    max_tokens=max_tokens,
                    return_num_output_tokens=True,
                    **MODES[mode],
                )
                if result.error:
                    raise RuntimeError(f"{mode}: {result.error}")
                tokens += int(result.metrics["num_output_tokens"])
            seconds = time.perf_counter() - start
            row = {
                "round": round_index,
                "mode": mode,
                "output_tokens": tokens,
                "tokens_per_s": tokens / seconds,
            }
            row.update(counter_deltas(before, scrape_metrics(metrics_url)))
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    parts = " ".join(f"{p} {row[f'{p}_ms_per_iteration']:.1f}" for p in TIMED_PARTS)
    proposers = " ".join(accepted_of_drafted(row))
    return (
        f"round {row['round']}  {row['mode']:<9} {row['tokens_per_s']:6.1f} tok/s  "
        f"{row['tokens_per_iteration']:.2f} tokens/iteration  accepted/drafted: {proposers}  "
        f"ms/iteration: {parts}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="grounded", choices=sorted(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--modes", default="ngram,adaptive,k0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--url", default=None, help="gRPC host:port; default: own server")
    parser.add_argument("--metrics-url", default=None, help="with --url")
    parser.add_argument("--server-env", default="DTYPE=bfloat16", help="own server: K=V,...")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "profile.json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = unknown_modes(modes)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; of {', '.join(MODES)}")
    prompts = load_prompts(WORKLOADS[args.workload])[: args.num_prompts]
    server = None
    if args.url is None:
        from specdec.harness import ManagedServer

        env = parse_env(args.server_env)
        server = ManagedServer("profile-modes", env)
    url = args.url or server.url
    metrics_url = args.metrics_url or server.metrics_url
    try:
        rows = profile(url, metrics_url, prompts, modes, args.rounds, args.max_tokens)
    finally:
        if server is not None:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "workload": args.workload,
        "num_prompts": len(prompts),
        "url": args.url,
        "server_env": args.server_env if args.url is None else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
