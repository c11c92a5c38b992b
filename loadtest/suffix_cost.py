"""What the suffix proposer costs the loop's host: a proposal for a row, and an emitted token
fed to the store, at 64 rows (issue 49: both must cost microseconds, not milliseconds).

No server and no model: the proposer (specdec/loop/proposers/suffix.py) over the target's
real tokens of the load tests' prompts. The store is first filled with the text of earlier
requests (every prompt file's prompts, as answers), then 64 rows decode: each step every row
gets an offer (both walks: its own text and the store) and commits 1 to 3 tokens (what a
verify emits), which feeds the store. Medians over the steps, in microseconds per row and
per token. Writes results/suffix-cost.json.

    .venv/bin/python loadtest/suffix_cost.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from common import WORKLOADS, read_prompts
from specdec.loop.config import SchedulerConfig
from specdec.loop.proposers.base import Candidate
from specdec.loop.proposers.suffix import SuffixProposer
from specdec.loop.sequence import SequenceState
from specdec.paths import PROJECT_ROOT
from specdec.text.request import GenerationRequest
from specdec.text.tokenizer import load_tokenizer


def corpus() -> list[list[int]]:
    """The target's tokens of every prompt of the load tests' prompt files (those of one
    request per prompt)."""
    tokenizer = load_tokenizer(str(PROJECT_ROOT / "models" / "smollm2-135m-instruct"))
    texts = [p for path in sorted(WORKLOADS.values()) for p in read_prompts(path)]
    return [tokenizer.encode(text) for text in texts]


def run(num_rows: int, num_steps: int, max_k: int) -> dict:
    texts = corpus()
    rng = random.Random(0)
    config = SchedulerConfig(
        num_slots=num_rows, max_context=4096, max_draft_tokens=max_k, default_draft_tokens=None
    )
    proposer = SuffixProposer(config, engines=None)  # type: ignore[arg-type]
    for i, text in enumerate(texts):  # earlier requests: their text in the store
        earlier = row(text[:8], 10_000 + i)
        earlier.token_ids += text[8:]
        proposer.committed([earlier])
    rows = [row(rng.choice(texts), i) for i in range(num_rows)]
    answers = [rng.choice(texts) for _ in range(num_rows)]
    offer_us, feed_us = [], []
    for _ in range(num_steps):
        started = time.perf_counter()
        for sequence in rows:
            proposer.offer(Candidate(sequence, max_k))
        offer_us.append((time.perf_counter() - started) / num_rows * 1e6)
        fed = 0
        for sequence, answer in zip(rows, answers, strict=True):
            emitted = rng.randint(1, 3)
            start = len(sequence.token_ids) - len(sequence.request.prompt_ids)
            sequence.token_ids += (answer * 4)[start : start + emitted]
            fed += emitted
        started = time.perf_counter()
        proposer.committed(rows)
        feed_us.append((time.perf_counter() - started) / fed * 1e6)
    counts = proposer.store.counts
    return {
        "rows": num_rows,
        "steps": num_steps,
        "max_k": max_k,
        "store_tokens": counts.num_tokens,
        "store_bytes": counts.num_bytes,
        "offer_us_per_row_median": statistics.median(offer_us),
        "offer_us_per_row_p90": statistics.quantiles(offer_us, n=10)[-1],
        "feed_us_per_token_median": statistics.median(feed_us),
        "feed_us_per_token_p90": statistics.quantiles(feed_us, n=10)[-1],
        "first_offer_us_per_row": offer_us[0],  # each row's own table built from its prompt
        "host": host(),
    }


def host() -> str:
    """The CPU's model name (the figures are one core's work)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def row(prompt: list[int], sequence_id: int) -> SequenceState:
    request = GenerationRequest(None, list(prompt), 4096)
    sequence = SequenceState(request, detokenizer=None, seed=0, token_ids=list(prompt))  # type: ignore[arg-type]
    sequence.id = sequence_id
    return sequence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "results" / "suffix-cost.json")
    args = parser.parse_args()
    report = run(args.rows, args.steps, args.max_k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
