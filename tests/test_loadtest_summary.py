"""`make loadtest`'s plan and accounting (loadtest/schedule.py, run_loadtest.py), pure logic
on scripted records; `make bench`'s window order and arguments (loadtest/bench.py); the
runs themselves are in test_loadtools."""

from __future__ import annotations

import sys

import pytest

from specdec.client import build_inputs
from specdec.paths import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from bench import parse_args, window_schedule  # noqa: E402
from common import MODES, mode_inputs, parse_env  # noqa: E402
from run_loadtest import DEFAULT_MODES, add_ratios, noise_floor, table, validity_line  # noqa: E402
from schedule import (  # noqa: E402
    build_plan,
    client_tokens_between,
    counter_between,
    segments_of,
    set_pure_intervals,
    summarize_segments,
    window_at,
)

S = 1_000_000_000  # ns per s


def test_plan_mirrors_the_modes_within_each_stage_and_reverses_them_at_the_next():
    plan = build_plan([4, 64, 512], ["k0", "adaptive", "k0-again"], 10.0)
    modes = [w.mode for w in plan]
    assert modes[:6] == ["k0", "adaptive", "k0-again", "k0-again", "adaptive", "k0"]
    assert modes[6:12] == ["k0-again", "adaptive", "k0", "k0", "adaptive", "k0-again"]
    assert [w.users for w in plan] == [4] * 6 + [64] * 6 + [512] * 6
    lengths = {w.users: w.end_s - w.start_s for w in plan}
    assert lengths == {4: 10.0, 64: 20.0, 512: 30.0}  # longer windows under a queue
    assert all(a.end_s == b.start_s for a, b in zip(plan, plan[1:], strict=False))
    assert [w.index for w in plan] == list(range(18))


def test_window_at_maps_run_time_to_the_window_in_force():
    plan = build_plan([1, 2], ["k0", "adaptive"], 5.0)  # 8 windows of 5 s
    assert window_at(plan, 0.0).index == 0
    assert window_at(plan, 4.99).index == 0
    assert window_at(plan, 5.0).index == 1
    assert window_at(plan, 39.9).index == 7
    assert window_at(plan, 40.0) is None
    assert window_at(plan, -1.0) is None


def request(window, sent, scheduled, first, last, tokens, outcome="ok", chunks=None, **extra):
    """A record as the locustfile writes it; times in s, converted to ns."""
    chunk_times = chunks if chunks is not None else [first + 0.01]
    return dict(
        window=window,
        outcome=outcome,
        sent_ns=int(sent * S),
        arrival_ns=int((sent + 0.001) * S),
        first_scheduled_ns=int(scheduled * S) if scheduled else 0,
        first_token_ns=int(first * S) if first else 0,
        last_token_ns=int(last * S) if last else 0,
        done_ns=int((last or sent) * S),
        chunk_ns=[int(t * S) for t in chunk_times],
        chunk_tokens=[round(tokens * (i + 1) / len(chunk_times)) for i in range(len(chunk_times))],
        tokens=tokens,
        **extra,
    )


def test_pure_interval_waits_for_the_other_modes_requests_to_leave_the_batch():
    # Windows: 0 = k0 [0, 10), 1 = adaptive [10, 20) (at one stage). With a queue, k0's
    # requests run until 14 s; adaptive's first gets a slot at 12 s and its last ends at 25.
    plan = build_plan([8], ["k0", "adaptive"], 10.0)[:2]
    records = [
        request(0, sent=1, scheduled=1, first=2, last=9, tokens=10),
        request(0, sent=8, scheduled=9, first=10, last=14, tokens=10),
        request(1, sent=11, scheduled=12, first=13, last=20, tokens=10),
        request(1, sent=19, scheduled=19, first=20, last=25, tokens=10),
        request(1, sent=19.5, scheduled=0, first=0, last=0, tokens=0, outcome="refused"),
    ]
    segments = segments_of(plan, records)
    set_pure_intervals(segments)
    k0, adaptive = segments
    assert (k0.start_ns, k0.end_ns) == (1 * S, 12 * S)  # until adaptive's first slot
    assert (adaptive.start_ns, adaptive.end_ns) == (14 * S, 25 * S)  # from k0's last token
    assert len(adaptive.requests) == 3  # the refused one too (no server times)


def test_a_switch_that_never_settles_leaves_no_interval():
    plan = build_plan([8], ["k0", "adaptive"], 10.0)[:2]
    records = [
        request(0, sent=1, scheduled=1, first=2, last=30, tokens=10),  # runs past all of 1
        request(1, sent=11, scheduled=12, first=13, last=20, tokens=10),
    ]
    segments = segments_of(plan, records)
    set_pure_intervals(segments)
    assert segments[1].seconds == 0
    records[0]["outcome"] = "unfinished"  # cut off by Locust; through the ensemble it runs on
    set_pure_intervals(segments)
    assert segments[1].seconds == 0
    records[0]["done_ns"] = 11 * S  # cut at 11 s, sent to the BLS: it stops there
    set_pure_intervals(segments, cancels_heard=True)
    assert (segments[1].start_ns, segments[1].end_ns) == (12 * S, 20 * S)


def test_adjacent_windows_of_one_mode_are_one_segment():
    plan = build_plan([8], ["k0", "adaptive"], 10.0)  # k0 adaptive adaptive k0
    segments = segments_of(plan, [])
    assert [(s.mode, s.windows) for s in segments] == [
        ("k0", [0]),
        ("adaptive", [1, 2]),
        ("k0", [3]),
    ]


def test_counter_is_interpolated_between_samples():
    samples = [(10.0, 100.0), (11.0, 110.0), (12.0, 130.0)]
    assert counter_between(samples, 10.0, 12.0) == 30.0
    assert counter_between(samples, 10.5, 11.5) == pytest.approx(15.0)
    assert counter_between(samples, 5.0, 20.0) == 30.0  # clamped to the samples


def test_client_tokens_count_the_growth_that_arrived_inside():
    record = request(0, 0, 0, 1, 4, tokens=30, chunks=[1.0, 2.0, 3.0])  # 10, 20, 30
    assert client_tokens_between([record], 0, 10 * S) == 30
    assert client_tokens_between([record], int(1.5 * S), int(2.5 * S)) == 10
    assert client_tokens_between([record], 3 * S, 10 * S) == 10


def test_summary_sets_client_against_server_and_counts_refusals_apart():
    plan = build_plan([8], ["k0"], 10.0)  # two k0 windows: one segment
    records = [
        request(0, sent=0, scheduled=0.5, first=1, last=4, tokens=30, chunks=[1.0, 2.0, 3.0]),
        request(1, sent=5, scheduled=5.5, first=6, last=9, tokens=30, chunks=[6.0, 7.0, 8.0]),
        request(1, sent=9, scheduled=0, first=0, last=0, tokens=0, outcome="refused"),
        request(1, sent=9, scheduled=0, first=0, last=0, tokens=0, outcome="failed"),
    ]
    # The server counted 60 tokens between 0.5 and 9 s, one every ~0.14 s.
    emitted = [(t / 10, 60 * min(1.0, max(0.0, (t / 10 - 0.5) / 8.5))) for t in range(0, 100)]
    segments = segments_of(plan, records)
    set_pure_intervals(segments)
    (row,) = summarize_segments(segments, records, {"emitted": emitted, "queued": [(5.0, 3.0)]})
    assert row["users"] == 8 and row["mode"] == "k0"
    assert row["counted_s"] == pytest.approx(8.5)
    assert row["server_tokens_per_s"] == pytest.approx(60 / 8.5, rel=0.01)
    assert row["client_over_server"] == pytest.approx(1.0, rel=0.01)
    assert row["requests"] == 4 and row["failures"] == 1 and row["refusals"] == 1
    assert row["refusal_p99_s"] == 0.0  # scripted: answered at once
    assert row["ttft_requests"] == 2
    assert row["ttft_p50_s"] == pytest.approx(1.0)  # sent 0, first chunk 1.0
    assert row["server_ttft_p50_s"] == pytest.approx(0.999)  # arrival 0.001, token 1
    assert row["inter_chunk_p50_s"] == pytest.approx(1.0)
    assert row["queue_max"] == 3.0


def test_summary_counts_guided_answers_by_validity_and_none_without_guides():
    plan = build_plan([2], ["k0"], 10.0)
    verdicts = ["valid", "valid", "cut", "invalid", "valid"]
    records = [
        request(0, sent=i, scheduled=i + 0.2, first=i + 0.5, last=i + 1, tokens=8, validity=v)
        for i, v in enumerate(verdicts)
    ]
    refused = request(1, sent=9, scheduled=0, first=0, last=0, tokens=0, outcome="refused")
    emitted = [(t / 10, float(t)) for t in range(100)]
    metrics = {"emitted": emitted, "queued": [(5.0, 0.0)]}
    segments = segments_of(plan, [*records, refused])
    set_pure_intervals(segments)
    (row,) = summarize_segments(segments, [*records, refused], metrics)
    assert (row["valid_outputs"], row["invalid_outputs"], row["cut_outputs"]) == (3, 1, 1)
    assert (
        validity_line([row])
        == "Structured answers valid/invalid/cut by users and mode: 2 k0 3/1/1\n"
    )
    for record in records:
        del record["validity"]
    segments = segments_of(plan, records)
    set_pure_intervals(segments)
    (row,) = summarize_segments(segments, records, metrics)
    assert row["valid_outputs"] is row["invalid_outputs"] is row["cut_outputs"] is None
    assert validity_line([row]) == ""


def stage_row(users: int, mode: str, server: float | None) -> dict:
    return dict(
        users=users,
        mode=mode,
        server_tokens_per_s=server,
        client_tokens_per_s=server,
        client_over_server=1.0 if server else None,
        ttft_p50_s=0.5,
        ttft_p99_s=1.5,
        server_ttft_p50_s=0.49,
        inter_chunk_p50_s=0.05,
        inter_chunk_p99_s=0.2,
        queue_mean=0.0,
        queue_max=0.0,
        counted_s=30.0,
        requests=10,
        failures=0,
        refusals=0,
        refusal_p99_s=None,
    )


def test_table_gives_each_mode_against_k0_of_its_stage_and_the_noise_floor():
    rows = [
        stage_row(1, "k0", 20.0),
        stage_row(1, "adaptive", 30.0),
        stage_row(1, "k0-again", 19.0),
        stage_row(64, "k0-again", 150.0),
        stage_row(64, "k0", 160.0),
        stage_row(64, "adaptive", None),  # no settled interval
    ]
    rows[-1].update(refusals=3, refusal_p99_s=0.004)
    add_ratios(rows)
    lines = table(rows).splitlines()
    assert lines[0].startswith("| users | mode | server tok/s | client tok/s |")
    assert len(lines) == 8
    assert lines[3].startswith("| 1 | adaptive | 30.0 | 30.0 | 1.000 | 1.50x |")
    assert lines[6].startswith("| 64 | k0 | 160.0 | 160.0 | 1.000 | 1.00x |")
    assert lines[7].startswith("| 64 | adaptive | - | - | - | - |")
    assert lines[7].endswith("| 0 | 3 (p99 4 ms) |")
    assert noise_floor(rows) == {1: pytest.approx(0.95), 64: pytest.approx(150 / 160)}


def test_stream_pool_lengthens_grpc_wait_slices():
    """Locust's users wait on their streams without waking every 0.1 s (grpc_streams.py):
    the pool sets gRPC's wait slice, and a gRPC without that constant fails loudly here."""
    import grpc._common

    from grpc_streams import WAIT_SLICE_S, StreamPool

    original = grpc._common.MAXIMUM_WAIT_TIMEOUT
    try:
        pool = StreamPool("127.0.0.1:1", num_channels=1)
        pool.close()
        assert grpc._common.MAXIMUM_WAIT_TIMEOUT == WAIT_SLICE_S > original
    finally:
        grpc._common.MAXIMUM_WAIT_TIMEOUT = original


def test_server_env_parses_pairs_and_refuses_a_name_without_a_value():
    assert parse_env("") == {}
    assert parse_env("DTYPE=bfloat16,NUM_SLOTS=4") == {"DTYPE": "bfloat16", "NUM_SLOTS": "4"}
    assert parse_env("PROPOSERS=") == {"PROPOSERS": ""}  # "" is a value: no speculation
    # a list's commas stay in its value
    assert parse_env("DTYPE=float32,PROPOSERS=draft_model,ngram,suffix,NUM_SLOTS=4") == {
        "DTYPE": "float32",
        "PROPOSERS": "draft_model,ngram,suffix",
        "NUM_SLOTS": "4",
    }
    assert parse_env("NGRAM_MATCH_LENGTHS=3,2,1") == {"NGRAM_MATCH_LENGTHS": "3,2,1"}
    for bad in ("DTYPE", "=bfloat16", "DTYPE=bfloat16,NUM_SLOTS", "ngram,DTYPE=float32"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse_env(bad)


def test_bench_mirrors_the_modes_in_each_round_and_reverses_them_at_the_next():
    assert window_schedule(["a", "b", "c"], 0) == ["a", "b", "c", "c", "b", "a"]
    assert window_schedule(["a", "b", "c"], 1) == ["c", "b", "a", "a", "b", "c"]
    rounds = window_schedule(["a", "b"], 0, rounds=3)
    assert rounds == ["a", "b", "b", "a", "b", "a", "a", "b", "a", "b", "b", "a"]


def test_bench_arguments_name_one_second_server_or_none():
    make_bench = parse_args(["--float32-concurrency", "32", "--server-env", "DTYPE=bfloat16"])
    second = make_bench.second
    assert (second.env, second.concurrency, second.rounds) == ({"DTYPE": "float32"}, 32, 1)
    assert (second.mode, second.workload) == ("k0-float32", "dtype")
    assert make_bench.server_env == {"DTYPE": "bfloat16"} and make_bench.concurrency == [
        1,
        4,
        16,
        64,
    ]
    only_b = parse_args(["--concurrency", "", "--env-b", "RESPONSE_THREAD=true", "--b-rounds", "2"])
    assert only_b.concurrency == [] and only_b.second.env == {"RESPONSE_THREAD": "true"}
    assert (only_b.second.mode, only_b.second.concurrency, only_b.second.rounds) == ("k0-b", 32, 2)
    assert {"k0", "k0-b", "k0-float32"} <= set(MODES)
    assert parse_args([]).second is None
    refused = (
        ["--float32-concurrency", "8", "--env-b", "DTYPE=float32"],  # two second servers
        ["--url-b", "127.0.0.1:1"],  # no metrics for it
        ["--concurrency", ""],  # nothing to measure
        ["--modes", "k0,k3"],  # not a mode
    )
    for argv in refused:
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_loadtest_default_modes_are_modes():
    assert set(DEFAULT_MODES) <= set(MODES) and "k0-again" in DEFAULT_MODES


def test_the_suffix_modes_name_their_proposers_as_the_server_reads_them():
    """adaptive-nosuffix sends both names in one BYTES tensor [1, 2] (the server's
    `proposer` input is [-1]); suffix sends one."""
    for mode, names in (("adaptive-nosuffix", [b"draft_model", b"ngram"]), ("suffix", [b"suffix"])):
        tensors = {t.name(): t for t in build_inputs("prompt", **mode_inputs(mode))}
        assert tensors["proposer"].shape() == [1, len(names)]
        assert tensors["proposer"].datatype() == "BYTES"
        raw = tensors["proposer"]._raw_content  # each name after its 4-byte length
        assert raw == b"".join(len(n).to_bytes(4, "little") + n for n in names)
        assert "num_draft_tokens" not in tensors  # the server chooses k
    assert "proposer" not in {t.name() for t in build_inputs("p", **mode_inputs("adaptive"))}
