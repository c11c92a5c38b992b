"""The load tools against a real server: a Locust smoke ramp and a short perf_analyzer run."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.launch import PROJECT_ROOT

pytestmark = pytest.mark.server


def test_locust_smoke_ramp_streams_without_failures(server, tmp_path: Path):
    records = tmp_path / "records.jsonl"
    locust = Path(sys.executable).parent / "locust"
    subprocess.run(
        [
            str(locust),
            "-f",
            str(PROJECT_ROOT / "loadtest" / "locustfile.py"),
            "--headless",
            "--host",
            server.url,
            "--smoke",
            "--max-tokens",
            "16",
            "--records",
            str(records),
            "--csv",
            str(tmp_path / "smoke"),
            "--only-summary",
        ],
        check=True,
        timeout=180,
        cwd=PROJECT_ROOT,
    )
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "smoke_stats.csv"))}
    assert int(rows["generate"]["Request Count"]) >= 3
    assert int(rows["generate"]["Failure Count"]) == 0
    assert int(rows["time_to_first_token"]["Request Count"]) == int(
        rows["generate"]["Request Count"]
    )
    assert int(rows["inter_chunk"]["Request Count"]) > 0
    recorded = [json.loads(line) for line in records.read_text().splitlines()]
    assert {r["outcome"] for r in recorded} == {"ok"}
    assert {r["users"] for r in recorded} <= {1, 2, 4}
    assert all(0 < r["tokens"] <= 16 and r["drafted"] >= 0 for r in recorded)


def test_perf_analyzer_streams_the_ensemble(server):
    port = server.url.rsplit(":", 1)[1]
    result = subprocess.run(
        [
            str(PROJECT_ROOT / "loadtest" / "perf_analyzer.sh"),
            "-m",
            "ensemble",
            "-u",
            f"127.0.0.1:{port}",
            "-i",
            "grpc",
            "--streaming",
            "--input-data",
            str(PROJECT_ROOT / "loadtest" / "perf_analyzer_inputs.json"),
            "--concurrency-range",
            "2",
            "--measurement-interval",
            "10000",
            # CI checks that it runs and measures, not that a shared CPU is stable.
            "--stability-percentage",
            "999",
            "--max-trials",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Concurrency: 2, throughput:" in result.stdout


def test_short_soak_has_no_failures_and_flat_memory(server, tmp_path: Path):
    # The CI variant of `make soak` (10 minutes there): one minute, 20 s of warm-up.
    completed = subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "loadtest" / "soak.py"),
            "--url",
            server.url,
            "--pid",
            str(server.process.pid),
            "--duration",
            "60",
            "--warmup",
            "20",
            "--concurrency",
            "4",
            "--max-tokens",
            "32",
            "--name",
            "soak-ci",
            "--out-dir",
            str(tmp_path),
        ],
        timeout=300,
        cwd=PROJECT_ROOT,
    )
    report = json.loads((tmp_path / "soak-ci.json").read_text())
    assert report["requests"] >= 8
    assert report["failures"] == 0, report["errors"]
    assert report["growth"] is not None and report["growth"] < 0.10
    assert completed.returncode == 0


def test_bench_interleaves_modes_and_counts_tokens(server, tmp_path: Path):
    """`make bench` in miniature: both modes, two windows each, figures from the server."""
    subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "loadtest" / "bench.py"),
            "--url",
            server.url,
            "--metrics-url",
            server.metrics_url,
            "--modes",
            "k0,adaptive",
            "--concurrency",
            "1,2",
            "--level-seconds",
            "6",
            "--max-tokens",
            "16",
            "--name",
            "bench-ci",
            "--out-dir",
            str(tmp_path),
        ],
        timeout=300,
        cwd=PROJECT_ROOT,
        check=True,
    )
    levels = json.loads((tmp_path / "bench-ci.json").read_text())["levels"]
    assert sorted((r["mode"], r["concurrency"]) for r in levels) == [
        ("adaptive", 1),
        ("adaptive", 2),
        ("k0", 1),
        ("k0", 2),
    ]
    for level in levels:
        assert level["num_errors"] == 0 and level["num_requests"] >= level["concurrency"] * 2
        assert len(level["window_tokens_per_s"]) == 2
        assert all(x > 0 for x in level["window_tokens_per_s"])
        assert level["tokens_per_s"] > 0 and level["latency_p99_s"] > 0
    k0 = [r for r in levels if r["mode"] == "k0"]
    assert all(r["draft_tokens_per_output_token"] == 0 for r in k0)
    with (tmp_path / "bench-ci.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4
    assert (tmp_path / "bench-ci.png").stat().st_size > 0
