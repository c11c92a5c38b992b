"""Do long prompts that join stall the running streams? (issue 31: chunked prefill)

    .venv/bin/python loadtest/long_prompt_join.py --name long-join \
        --server-envs "PREFILL_CHUNK=256;PREFILL_CHUNK=0"

For each server setting (one server each, started in turn): `--streams` running streams send
chat prompts back to back (streamed, greedy, `--max-tokens`, stream_interval 1) while one
joiner sends prompts back to back, in windows of `--window-seconds`: "short" windows send chat
prompts, "long" windows prompts of about `--long-tokens` tokens, each unique from its first
token (so no prefix is reused: each is prefilled whole or in chunks). Windows run mirrored
(short, long, long, short, repeated `--rounds` times), so drift hits both alike.

Reported per setting: the running streams' inter-token latency (the gap between two chunks of
one response, both inside the window) p50 and p99 in each kind of window, long p99 / short
p99, and the noise floor: the two short windows of a round against each other (the larger
p99 over the smaller). results/<name>.{json,csv}.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import WORKLOADS, load_prompts, percentile
from specdec.client import StreamingClient
from specdec.paths import PROJECT_ROOT

WINDOWS = ("short", "long", "long", "short")  # one round, mirrored
WORDS = (
    "harbour ledger copper signal valley orchard lantern engine timber canal meadow "
    "furnace bridge weaver granary compass quarry beacon mill thatch anvil ferry "
    "chapel tannery kiln orchard barrow glazier cooper chandler wharf"
).split()


@dataclass
class Window:
    kind: str  # short or long
    start: float  # time.time()
    end: float = 0.0
    gaps: list[float] = field(default_factory=list)  # the running streams' inter-token s
    num_joined: int = 0  # the joiner's requests that finished inside it


@dataclass
class SettingResult:
    setting: str
    short_itl_p50_ms: float | None
    short_itl_p99_ms: float | None
    long_itl_p50_ms: float | None
    long_itl_p99_ms: float | None
    long_over_short_p99: float | None
    noise_floor_p99: float | None  # short vs short, the larger over the smaller
    num_long_joined: int
    num_short_joined: int


def long_prompt(index: int, num_tokens: int) -> str:
    """A prompt of about `num_tokens` tokens, unique from its
    first words on (about 1.5 tokens a word with this vocabulary)."""
    rng = random.Random(index)
    words = [f"Record {index}-{rng.randrange(10**6)}:"]
    while len(words) < num_tokens * 0.65:
        sentence = rng.sample(WORDS, 6)
        words += [*sentence[:-1], sentence[-1] + "."]
    return " ".join(words) + "\nQuestion: which word came first in the record?\nAnswer:"


class Run:
    """The running streams and the joiner against one server, window by window."""

    def __init__(self, url: str, args: argparse.Namespace, prompts: list[str]) -> None:
        self.url, self.args, self.prompts = url, args, prompts
        self.windows: list[Window] = []
        self.stopping = False
        self.lock = threading.Lock()

    def current(self) -> Window | None:
        with self.lock:
            return self.windows[-1] if self.windows else None

    def runner(self, index: int) -> None:
        with StreamingClient(self.url, "speculative_decoding") as client:
            sent = 0
            while not self.stopping:
                prompt = self.prompts[(index + sent * self.args.streams) % len(self.prompts)]
                sent += 1
                left = time.time()
                result = client.generate(
                    prompt, max_tokens=self.args.max_tokens, stream=True, end_id=-1
                )
                if result.error is not None:
                    raise RuntimeError(f"a running stream failed: {result.error}")
                self.book_gaps([left + t for t in result.chunk_times])

    def book_gaps(self, times: list[float]) -> None:
        with self.lock:
            for earlier, later in zip(times, times[1:], strict=False):
                for window in self.windows:
                    end = window.end or float("inf")
                    if window.start <= earlier and later <= end:
                        window.gaps.append(later - earlier)

    def joiner(self) -> None:
        short_index = long_index = 0
        with StreamingClient(self.url, "speculative_decoding") as client:
            while not self.stopping:
                window = self.current()
                if window is None:
                    time.sleep(0.05)
                    continue
                if window.kind == "long":
                    prompt = long_prompt(long_index, self.args.long_tokens)
                    long_index += 1
                else:
                    prompt = self.prompts[short_index % len(self.prompts)]
                    short_index += 1
                result = client.generate(prompt, max_tokens=8, end_id=-1)
                if result.error is not None:
                    raise RuntimeError(f"the joiner failed: {result.error}")
                done = time.time()
                if window.end == 0.0 or done <= window.end:
                    window.num_joined += 1

    def measure(self) -> list[Window]:
        threads = [
            threading.Thread(target=self.runner, args=(i,), daemon=True)
            for i in range(self.args.streams)
        ] + [threading.Thread(target=self.joiner, daemon=True)]
        for thread in threads:
            thread.start()
        time.sleep(self.args.warmup_seconds)
        for _ in range(self.args.rounds):
            for kind in WINDOWS:
                with self.lock:
                    self.windows.append(Window(kind, time.time()))
                time.sleep(self.args.window_seconds)
                with self.lock:
                    self.windows[-1].end = time.time()
        self.stopping = True
        for thread in threads:
            thread.join(timeout=600)
        return self.windows


def summarize(setting: str, windows: list[Window]) -> SettingResult:
    def p(kind: str, q: float) -> float | None:
        gaps = [g for w in windows if w.kind == kind for g in w.gaps]
        value = percentile(gaps, q)
        return None if value is None else value * 1000

    shorts = [w for w in windows if w.kind == "short"]
    floors = []
    for first, second in zip(shorts[::2], shorts[1::2], strict=False):
        a, b = percentile(first.gaps, 99), percentile(second.gaps, 99)
        if a and b:
            floors.append(max(a, b) / min(a, b))
    short99, long99 = p("short", 99), p("long", 99)
    return SettingResult(
        setting=setting,
        short_itl_p50_ms=p("short", 50),
        short_itl_p99_ms=short99,
        long_itl_p50_ms=p("long", 50),
        long_itl_p99_ms=long99,
        long_over_short_p99=long99 / short99 if long99 and short99 else None,
        noise_floor_p99=max(floors) if floors else None,
        num_long_joined=sum(w.num_joined for w in windows if w.kind == "long"),
        num_short_joined=sum(w.num_joined for w in windows if w.kind == "short"),
    )


def parse_env(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def run(args: argparse.Namespace) -> list[SettingResult]:
    from specdec.harness import ManagedServer

    prompts = load_prompts(WORKLOADS["chat"])
    results = []
    for setting in args.server_envs.split(";"):
        env = {**parse_env(args.server_env), **parse_env(setting)}
        server = ManagedServer(f"long-join-{len(results)}", env)
        try:
            windows = Run(server.url, args, prompts).measure()
        finally:
            server.stop()
        result = summarize(setting, windows)
        print(
            f"{setting or 'default'}: running streams' inter-token p99 "
            f"{result.short_itl_p99_ms:.0f} ms with short prompts joining, "
            f"{result.long_itl_p99_ms:.0f} ms with long ones: "
            f"{result.long_over_short_p99:.2f}x (noise floor {result.noise_floor_p99:.2f}x; "
            f"joined {result.num_short_joined} short, {result.num_long_joined} long)",
            flush=True,
        )
        results.append(result)
    write(args, results)
    return results


def write(args: argparse.Namespace, results: list[SettingResult]) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items()}
    rows = [asdict(r) for r in results]
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    with open(out / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="long-join")
    parser.add_argument("--out-dir", default=str(PROJECT_ROOT / "results"))
    parser.add_argument("--server-env", default="", help="for every server, e.g. DTYPE=float32")
    parser.add_argument(
        "--server-envs",
        default="PREFILL_CHUNK=256;PREFILL_CHUNK=0",
        help="';'-separated settings, one server each",
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--window-seconds", type=float, default=30.0)
    parser.add_argument("--warmup-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
