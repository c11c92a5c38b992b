"""The load tools against a real server: `make loadtest` in miniature, Locust on the OpenAI
API, a short perf_analyzer run, a short soak, `make bench` in miniature (with its
second-server comparison) and profile_modes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.client import scrape_metrics, wait_until_idle
from specdec.paths import PROJECT_ROOT
from specdec.serving.metric_names import LOOP_PARTS
from test_openai_api import api  # noqa: F401 - the fixture: the API on the test server

pytestmark = pytest.mark.server
B_STREAMS = 11  # the bench's second-server streams: more than the self-draft server's 8 slots


def test_make_loadtest_smoke_interleaves_modes_and_agrees_with_the_server(server, tmp_path: Path):
    """`make loadtest` in miniature: 1 and 2 users, k0 / adaptive / k0-again in 3 s windows;
    Locust's entries, the records, and the summary's client against server tokens."""
    subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "loadtest" / "run_loadtest.py"),
            "--smoke",
            "--url",
            server.url,
            "--metrics-url",
            server.metrics_url,
            "--out-dir",
            str(tmp_path),
        ],
        check=True,
        timeout=300,
        cwd=PROJECT_ROOT,
    )
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "locust_stats.csv"))}
    assert int(rows["generate"]["Request Count"]) >= 3
    assert int(rows["generate"]["Failure Count"]) == 0
    assert int(rows["time_to_first_token"]["Request Count"]) == int(
        rows["generate"]["Request Count"]
    )
    assert int(rows["inter_chunk"]["Request Count"]) > 0
    plan = json.loads((tmp_path / "plan.json").read_text())["windows"]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["outcome"] for r in records} <= {"ok", "unfinished"}
    counted = [r for r in records if r["window"] >= 0]
    # Each window's requests in its mode (on a slow machine a 3 s window may start none).
    modes = {r["mode"] for r in counted}
    assert len(modes) >= 2 and modes <= {"k0", "adaptive", "k0-again"}
    for r in counted:
        window = plan[r["window"]]
        assert (r["mode"], r["users"]) == (window["mode"], window["users"])
    for r in (r for r in records if r["outcome"] == "ok"):
        assert 0 < r["tokens"] <= 16 and r["chunk_tokens"][-1] == r["tokens"]
        assert r["arrival_ns"] <= r["first_scheduled_ns"] <= r["first_token_ns"]
        assert r["first_token_ns"] <= r["last_token_ns"] <= r["done_ns"]
        assert r["sent_ns"] < r["chunk_ns"][0]
    assert all(r["drafted"] == 0 for r in records if r["mode"] != "adaptive")
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = summary["stages"]
    assert {(s["users"], s["mode"]) for s in stages} == {
        (u, m) for u in (1, 2) for m in ("k0", "adaptive", "k0-again")
    }
    assert all(s["failures"] == 0 and s["refusals"] == 0 for s in stages)
    # Over the intervals each mode ran alone, the tokens the users received and those the
    # server counted (sampled twice a second, so a few tokens apart at the edges).
    timed = [s for s in stages if s["server_tokens_per_s"]]
    assert sum(s["counted_s"] for s in timed) > 10
    server_tokens = sum(s["server_tokens_per_s"] * s["counted_s"] for s in timed)
    client_tokens = sum(s["client_tokens_per_s"] * s["counted_s"] for s in timed)
    assert client_tokens == pytest.approx(server_tokens, rel=0.15)
    assert (tmp_path / "summary.png").stat().st_size > 0
    assert "| users | mode |" in (tmp_path / "summary.md").read_text()


def test_locust_openai_user_streams_chat_completions(api, tmp_path: Path):  # noqa: F811
    records = tmp_path / "records.jsonl"
    subprocess.run(
        [
            str(Path(sys.executable).parent / "locust"),
            "-f",
            str(PROJECT_ROOT / "loadtest" / "locustfile.py"),
            "OpenAIUser",
            "--headless",
            "--host",
            api.removesuffix("/v1"),
            "-u",
            "2",
            "-r",
            "2",
            "--run-time",
            "20s",
            "--max-tokens",
            "16",
            "--num-draft-tokens",
            "0",
            "--records",
            str(records),
            "--csv",
            str(tmp_path / "openai"),
            "--only-summary",
        ],
        check=True,
        timeout=180,
        cwd=PROJECT_ROOT,
    )
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "openai_stats.csv"))}
    assert int(rows["generate"]["Request Count"]) >= 2
    assert int(rows["generate"]["Failure Count"]) == 0
    assert int(rows["time_to_first_token"]["Request Count"]) == int(
        rows["generate"]["Request Count"]
    )
    assert int(rows["inter_chunk"]["Request Count"]) > 0
    assert int(rows["tokens_per_s"]["Request Count"]) == int(rows["generate"]["Request Count"])
    done = [json.loads(line) for line in records.read_text().splitlines()]
    done = [r for r in done if r["outcome"] == "ok"]
    assert done and all(r["mode"] == "k0" for r in done)
    assert all(0 < r["tokens"] <= 16 and len(r["chunk_ns"]) >= 2 for r in done)
    assert all(r["sent_ns"] < r["chunk_ns"][0] <= r["done_ns"] for r in done)


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
            # Windows that last until 4 requests have finished, not a fixed time: a loaded
            # 2-core machine once finished no request inside a 10 s window ("No valid
            # requests recorded within time interval"), and 20 s windows took a minute.
            "--measurement-mode",
            "count_windows",
            "--measurement-request-count",
            "4",
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


def requests_finished(metrics_url: str) -> float:
    """Requests the server has finished, every outcome."""
    values = scrape_metrics(metrics_url)
    return sum(v for k, v in values.items() if k.startswith("specdec_requests_total"))


def test_bench_interleaves_modes_and_counts_tokens(server, self_draft_server, tmp_path: Path):
    """`make bench` in miniature: both modes, two windows each, figures from the server;
    then k = 0 against a second server in mirrored windows: the self-draft server (--url-b),
    whose 8 slots cap its batch below the 11 streams the first one (32 slots) runs at once."""
    wait_until_idle(self_draft_server.metrics_url)
    finished_b = requests_finished(self_draft_server.metrics_url)
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
            # windows of 6 s: with 3 s, a loaded machine once finished no request past the
            # lead-ins in a window
            "--level-seconds",
            "12",
            "--max-tokens",
            "16",
            "--url-b",
            self_draft_server.url,
            "--metrics-url-b",
            self_draft_server.metrics_url,
            "--b-concurrency",
            str(B_STREAMS),
            "--name",
            "bench-ci",
            "--out-dir",
            str(tmp_path),
        ],
        timeout=480,  # a hang guard: 11 streams on a loaded 2-core machine are slow
        cwd=PROJECT_ROOT,
        check=True,
    )
    report = json.loads((tmp_path / "bench-ci.json").read_text())
    levels = [r for r in report["levels"] if r["workload"] == "chat"]
    assert sorted((r["mode"], r["concurrency"]) for r in levels) == [
        ("adaptive", 1),
        ("adaptive", 2),
        ("k0", 1),
        ("k0", 2),
    ]
    for level in levels:
        assert level["num_errors"] == 0 and level["num_requests"] >= level["concurrency"]
        assert len(level["window_tokens_per_s"]) == 2
        assert all(x > 0 for x in level["window_tokens_per_s"])
        assert level["tokens_per_s"] > 0 and level["latency_p99_s"] > 0
        # where the server's loop spent the counted windows, from its counters
        assert level["tokens_per_iteration"] >= 1.0
        assert level["target_ms_per_iteration"] > 0 and level["respond_ms_per_iteration"] > 0
    k0 = [r for r in levels if r["mode"] == "k0"]
    assert all(r["draft_tokens_per_output_token"] == 0 for r in k0)
    assert all(r["tokens_per_iteration"] == pytest.approx(r["concurrency"], rel=0.5) for r in k0)
    with (tmp_path / "bench-ci.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4 + 2
    assert (tmp_path / "bench-ci.png").stat().st_size > 0
    check_the_sides(report, requests_finished(self_draft_server.metrics_url) - finished_b)


def check_the_sides(report: dict, finished_on_b: float) -> None:
    """The second-server comparison: A (k0) on the test server, B (k0-b) on the self-draft
    server, each side's figures its own server's. `finished_on_b`: what B's server counted."""
    sides = {r["mode"]: r for r in report["levels"] if r["workload"] == "env-b"}
    assert set(sides) == {"k0", "k0-b"}
    assert report["meta"]["second_server"]["concurrency"] == B_STREAMS
    for level in sides.values():
        assert level["concurrency"] == B_STREAMS and level["num_errors"] == 0
        assert level["num_requests"] >= 1 and len(level["window_tokens_per_s"]) == 2
        assert level["tokens_per_s"] > 0 and level["target_ms_per_iteration"] > 0
        assert level["draft_tokens_per_output_token"] == 0  # k = 0 on both sides
    # B never runs more rows than its 8 slots (k = 0: a token per row and iteration); A runs
    # nearly all 11 streams at once.
    assert sides["k0-b"]["tokens_per_iteration"] <= 8
    assert sides["k0"]["tokens_per_iteration"] > 8
    # B's server finished B's requests (those counted, a lead-in per stream in each of its
    # two windows, bench's warm-up) and none of A's.
    assert finished_on_b == sides["k0-b"]["num_requests"] + 2 * B_STREAMS + 1


def test_profile_modes_splits_the_loop_time_of_each_mode(server, tmp_path: Path):
    """The same prompt through k = 0 and prompt lookup: k = 0 drafts nothing and its
    iterations emit one token each; every mode's loop parts add up to time spent."""
    out = tmp_path / "profile.json"
    wait_until_idle(server.metrics_url)  # its counters must see this test's requests alone
    subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "loadtest" / "profile_modes.py"),
            "--url",
            server.url,
            "--metrics-url",
            server.metrics_url,
            "--modes",
            "k0,ngram",
            "--rounds",
            "1",
            "--num-prompts",
            "1",
            "--max-tokens",
            "24",
            "--out",
            str(out),
        ],
        timeout=300,
        cwd=PROJECT_ROOT,
        check=True,
    )
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"k0", "ngram"}
    k0, ngram = rows["k0"], rows["ngram"]
    # One prompt on one stream, the server otherwise idle: its counters count exactly that
    # request, which runs to max_tokens (no end token in the first 24).
    for row in rows.values():
        assert row["output_tokens"] == row["emitted_tokens"] == 24
    assert k0["ngram_draft_tokens"] == k0["draft_model_draft_tokens"] == 0
    assert k0["iterations"] == 24 and k0["tokens_per_iteration"] == 1.0  # a token each
    assert ngram["draft_model_draft_tokens"] == 0
    assert 0 < ngram["ngram_accepted"] <= ngram["ngram_draft_tokens"]
    # each iteration emits its accepted tokens and one of the target's
    assert ngram["iterations"] + ngram["ngram_accepted"] == 24
    for row in rows.values():
        assert row["target_ms_per_iteration"] > 0 and row["respond_ms_per_iteration"] > 0
        # The loop's parts fit in the time the client waited for the request (give or take
        # the last hand-over, counted after the client had its answer).
        loop_ms = sum(row[f"{p}_ms_per_iteration"] for p in LOOP_PARTS) * row["iterations"]
        assert loop_ms / 1000 <= row["output_tokens"] / row["tokens_per_s"] + 0.05


def test_metrics_push_cost_times_the_loop_s_metrics_on_a_server_of_its_own(tmp_path: Path):
    """loadtest/metrics_push_cost.py in miniature: a report per row count, whose histogram
    push makes at least a call per histogram series it changed (bucket, sum, count)."""
    out = tmp_path / "push.json"
    subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "loadtest" / "metrics_push_cost.py"),
            "--rows",
            "1,8",
            "--iterations",
            "20",
            "--out",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    reports = json.loads(out.read_text())
    assert [r["rows"] for r in reports] == [1, 8]
    for report in reports:
        assert report["iterations"] == 20
        assert report["histogram_calls_per_flush"] >= 3  # the inter-token bucket, sum, count
        for part in ("observe", "stage", "flush", "counters"):
            assert 0 < report[part]["median_us"] <= report[part]["p90_us"], (report, part)
