"""`make loadtest`'s summary of Locust's per-request records: per stage and run, and the
table of each run against k = 0 (pure logic; the ramp itself runs in test_loadtools)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.launch import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from run_loadtest import ratio_table, summarize  # noqa: E402


def write_records(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def ok(users: int, t: float, elapsed: float, tokens: int, ttft: float, drafted: int = 0):
    return dict(
        outcome="ok", users=users, t=t, elapsed=elapsed, tokens=tokens, ttft=ttft, drafted=drafted
    )


def test_summarize_counts_each_stage_from_first_start_to_last_finish(tmp_path: Path):
    records = write_records(
        tmp_path / "adaptive.records.jsonl",
        [
            ok(1, t=12.0, elapsed=2.0, tokens=40, ttft=0.1, drafted=10),
            ok(1, t=14.0, elapsed=2.0, tokens=60, ttft=0.3),
            ok(2, t=20.0, elapsed=5.0, tokens=100, ttft=0.2),
            dict(outcome="broken", users=2, t=21.0, elapsed=1.0),
            dict(outcome="rejected", users=2, t=21.5, elapsed=0.1),
        ],
    )
    one, two = summarize(records)
    assert one["users"] == 1 and one["requests"] == 2 and one["failures"] == 0
    assert one["tokens_per_s"] == pytest.approx(100 / 4.0)  # starts at 10, ends at 14
    assert one["ttft_p50_s"] == 0.1 and one["ttft_p99_s"] == 0.3
    assert one["draft_tokens_per_output_token"] == pytest.approx(0.1)
    assert two["requests"] == 3 and two["failures"] == 1 and two["rejected"] == 1
    assert two["tokens_per_s"] == pytest.approx(100 / 6.5)  # starts at 15, ends at 21.5
    assert two["draft_tokens_per_output_token"] == 0.0


def test_ratio_table_puts_each_run_against_k0(tmp_path: Path):
    def stage(users: int, tokens_per_s: float, failures: int = 0) -> dict:
        return dict(
            users=users,
            requests=3,
            failures=failures,
            rejected=0,
            tokens_per_s=tokens_per_s,
            ttft_p50_s=0.2,
            ttft_p99_s=0.4,
            draft_tokens_per_output_token=0.0,
        )

    table = ratio_table(
        {
            "k0": [stage(1, 20.0), stage(2, 40.0)],
            "adaptive": [stage(1, 10.0), stage(2, 44.0, failures=1)],
            "k0-again": [stage(1, 20.0)],
        }
    ).splitlines()
    assert table[0].startswith("| users | k0 tok/s |")
    assert len(table) == 4
    assert table[2].startswith("| 1 | 20.0 |") and "10.0 (0.50x)" in table[2]
    assert "20.0 (1.00x)" in table[2] and table[2].endswith("| 0 |")
    assert "44.0 (1.10x)" in table[3] and table[3].endswith("| 1 |")
    assert table[3].endswith("0.000 |  |  |  | 1 |")  # k0-again has no stage at 2 users
