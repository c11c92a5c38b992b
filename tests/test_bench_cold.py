"""bench's cold-start mode (loadtest/cold_start.py, `bench.py --cold-start`): which prompts a
burst sends and in what order, the arms' order by round, the ratio table and its noise floor
without a server; then two arms, each on a server started for it, with tiny bursts."""

from __future__ import annotations

import csv
import json
import os
import sys

import pytest

from specdec.client import GenerationResult
from specdec.paths import PROJECT_ROOT

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
import cold_start  # noqa: E402
from bench import build_parser, cold_config  # noqa: E402
from cold_start import (  # noqa: E402
    ColdConfig,
    Phase,
    PhaseResult,
    arm_order,
    burst_plan,
    noise_floor,
    ratio_rows,
    table,
)


def test_a_burst_sends_the_same_prompts_in_order_wrapping_around():
    assert [phase.name for phase in cold_start.PHASES] == ["1 stream", "16 streams"]
    first, second = burst_plan(96)
    assert first == [0, 1, 2, 3]
    assert second == list(range(4, 36))
    first, second = burst_plan(10)  # a file shorter than the burst: round again
    assert first == [0, 1, 2, 3]
    assert second == [4, 5, 6, 7, 8, 9] + list(range(10)) * 2 + [0, 1, 2, 3, 4, 5]
    assert burst_plan(5, (Phase(1, 1), Phase(2, 2))) == [[0], [1, 2]]


def test_the_arms_order_is_mirrored_from_round_to_round():
    arms = cold_start.ARMS
    assert arm_order(arms, 0) == ["k0", "adaptive", "k0-again"]
    assert arm_order(arms, 1) == ["k0-again", "adaptive", "k0"]
    assert arm_order(arms, 2) == arm_order(arms, 0)


def result(workload: str, round_index: int, arm: str, phase: str, tokens_per_s: float):
    return PhaseResult(
        workload, round_index, arm, phase, 1, 4, 0, 256, 256.0, 100.0, 256 / tokens_per_s,
        tokens_per_s, 1, 8001, 0.0, [64] * 4,
    )  # fmt: skip


def test_ratios_by_round_their_means_and_the_noise_floor():
    rates = {  # (round, phase): k0, adaptive, k0-again tokens/s
        (0, "1 stream"): (100.0, 90.0, 95.0),
        (1, "1 stream"): (80.0, 88.0, 84.0),
        (0, "16 streams"): (200.0, 300.0, 220.0),
        (1, "16 streams"): (250.0, 250.0, 200.0),
    }
    results = [
        result("chat", n, arm, phase, rate)
        for (n, phase), values in rates.items()
        for arm, rate in zip(cold_start.ARMS, values, strict=True)
    ]
    rows = ratio_rows(results, cold_start.ARMS)
    by_key = {(row["phase"], row["round"]): row for row in rows}
    assert [(row["phase"], row["round"]) for row in rows] == [
        ("1 stream", 0),
        ("1 stream", 1),
        ("1 stream", "mean"),
        ("16 streams", 0),
        ("16 streams", 1),
        ("16 streams", "mean"),
    ]
    assert by_key[("1 stream", 0)]["adaptive/k0"] == pytest.approx(0.9)
    assert by_key[("1 stream", 1)]["adaptive/k0"] == pytest.approx(1.1)
    assert by_key[("1 stream", 1)]["k0-again/k0"] == pytest.approx(1.05)
    # over both k = 0 servers: the geometric mean of k0 and k0-again
    assert by_key[("1 stream", 0)]["adaptive/both k0"] == pytest.approx(90 / (100 * 95) ** 0.5)
    assert by_key[("16 streams", 1)]["adaptive/both k0"] == pytest.approx(250 / (250 * 200) ** 0.5)
    mean = by_key[("1 stream", "mean")]
    assert mean["adaptive/k0"] == pytest.approx(1.0)  # the mean of the ratios
    assert mean["k0-again/k0"] == pytest.approx(1.0)
    assert mean["k0 tok/s"] == pytest.approx(90.0)
    assert by_key[("16 streams", "mean")]["adaptive/k0"] == pytest.approx(1.25)
    assert mean["adaptive/both k0"] == pytest.approx((90 / 9500**0.5 + 88 / 6720**0.5) / 2)
    assert "adaptive/adaptive" not in mean and "k0/k0" not in mean
    assert "k0-again/both k0" not in mean
    assert noise_floor(rows) == pytest.approx(0.8)  # 16 streams, round 1: a round, not a mean
    printed = table(rows)
    assert "| chat | 1 stream | mean | 90.0 | 89.0 | 89.5 | 1.00x | 1.00x | 1.00x |" in printed

    one_round = ratio_rows([r for r in results if r.round == 0], ("k0", "adaptive", "k0-again"))
    assert [row["round"] for row in one_round] == [0, 0]  # no mean of one round
    two_arms = ratio_rows([r for r in results if r.arm != "k0-again"], ("k0", "adaptive"))
    assert "k0-again/k0" not in two_arms[0] and noise_floor(two_arms) is None
    assert "adaptive/both k0" not in two_arms[0]  # no second k = 0 server to pair


def test_a_run_gives_each_arm_its_burst_in_mirrored_order_and_writes_the_table(
    monkeypatch, tmp_path
):
    """run() without servers: the bursts it asks for, and the files it writes."""
    calls = []

    def fake_burst(config, workload, round_index, arm, prompts):
        calls.append((workload, round_index, arm))
        rate = {"k0": 100.0, "adaptive": 120.0, "k0-again": 98.0}[arm]
        return [result(workload, round_index, arm, p.name, rate) for p in config.phases]

    monkeypatch.setattr(cold_start, "cold_burst", fake_burst)
    monkeypatch.setattr(cold_start, "chat_template", lambda: lambda messages: "a")
    config = ColdConfig(["chat", "grounded"], name="t", out_dir=tmp_path, rounds=2)
    cold_start.run(config)
    assert calls == [
        ("chat", 0, "k0"), ("chat", 0, "adaptive"), ("chat", 0, "k0-again"),
        ("chat", 1, "k0-again"), ("chat", 1, "adaptive"), ("chat", 1, "k0"),
        ("grounded", 0, "k0-again"), ("grounded", 0, "adaptive"), ("grounded", 0, "k0"),
        ("grounded", 1, "k0"), ("grounded", 1, "adaptive"), ("grounded", 1, "k0-again"),
    ]  # fmt: skip
    document = json.loads((tmp_path / "t-cold.json").read_text())
    assert document["meta"]["noise_floor"] == pytest.approx(0.98)
    assert len(document["bursts"]) == 24  # 2 workloads x 2 rounds x 3 arms x 2 phases
    assert len(document["ratios"]) == 12  # 2 workloads x 2 phases x (2 rounds + mean)
    with (tmp_path / "t-cold.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[0]["adaptive/k0"]) == pytest.approx(1.2)


def test_a_phase_takes_its_prompts_in_order_from_one_queue(monkeypatch):
    sent = []

    class FakeClient:
        def __init__(self, url, model):
            pass

        def generate(self, prompt, **params):
            sent.append(prompt)
            assert params["max_tokens"] == 8 and params["num_draft_tokens"] == 0
            return GenerationResult(text=prompt, metrics={"num_output_tokens": 8})

        def close(self):
            pass

    monkeypatch.setattr(cold_start, "StreamingClient", FakeClient)
    prompts = ["p0", "p1", "p2", "p3"]
    results, seconds = cold_start.send_phase(
        "url", "ensemble", prompts, 1, 8, {"num_draft_tokens": 0}
    )
    assert sent == prompts and [r.text for r in results] == prompts and seconds >= 0
    sent.clear()
    results, _ = cold_start.send_phase("url", "ensemble", prompts, 3, 8, {"num_draft_tokens": 0})
    assert sorted(sent) == prompts and [r.text for r in results] == prompts  # by prompt


def test_the_bench_command_line_sets_up_the_cold_start():
    parser = build_parser()
    args = parser.parse_args(
        "--cold-start --workloads chat,grounded --cold-rounds 2 --cold-max-tokens 16 "
        "--server-env DTYPE=float32 --name x".split()
    )
    config = cold_config(parser, args)
    assert (config.workloads, config.rounds, config.max_tokens) == (["chat", "grounded"], 2, 16)
    assert (config.server_env, config.name, config.arms) == (
        {"DTYPE": "float32"},
        "x",
        cold_start.ARMS,
    )
    assert args.cold_start and not build_parser().parse_args([]).cold_start
    for bad in ("--cold-rounds 0", "--workloads nope", "--url 127.0.0.1:8001"):
        with pytest.raises(SystemExit):
            cold_config(parser, parser.parse_args(["--cold-start", *bad.split()]))
    with pytest.raises(ValueError):
        ColdConfig(["chat"], arms=("adaptive", "k0-again")).validate()  # no k0 to divide by


@pytest.mark.server
def test_each_arm_meets_its_burst_on_a_fresh_server(target_dir, tmp_path):
    """Two arms, tiny bursts (1 request, then 2 on 2 streams, 8 tokens): each on its own
    server, which had served nothing when the burst began and is gone afterwards; the tokens
    counted are the ones the responses carried, and the server's counter agrees."""
    phases = (Phase(1, 1), Phase(2, 2))
    config = ColdConfig(
        ["chat"],
        server_env={"NUM_SLOTS": "4", "MAX_CONTEXT": "1024"},
        name="test-bench",
        out_dir=tmp_path,
        max_tokens=8,
        arms=("k0", "adaptive"),
        phases=phases,
    )
    cold_start.run(config)
    document = json.loads((tmp_path / "test-bench-cold.json").read_text())
    bursts = document["bursts"]
    assert [(b["arm"], b["phase"]) for b in bursts] == [
        ("k0", "1 stream"),
        ("k0", "2 streams"),
        ("adaptive", "1 stream"),
        ("adaptive", "2 streams"),
    ]
    servers = {b["arm"]: (b["server_pid"], b["grpc_port"]) for b in bursts}
    assert len(set(servers.values())) == 2  # a server per arm
    assert all(servers[b["arm"]] == (b["server_pid"], b["grpc_port"]) for b in bursts)
    assert all(b["requests_at_start"] == 0 for b in bursts)  # fresh: nothing served before
    for pid, _ in servers.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped after its burst
    for burst, phase in zip(bursts, phases * 2, strict=True):
        assert (burst["num_requests"], burst["num_errors"]) == (phase.num_requests, 0)
        assert len(burst["tokens_per_request"]) == phase.num_requests
        assert all(1 <= n <= 8 for n in burst["tokens_per_request"])
        assert burst["output_tokens"] == sum(burst["tokens_per_request"]) == burst["server_tokens"]
        assert burst["seconds"] > 0 and burst["tokens_per_s"] > 0
        counted = burst["server"]  # where the burst's time went, and what it drafted
        per_iteration = burst["server_tokens"] / burst["iterations"]
        assert counted["tokens_per_iteration"] == pytest.approx(per_iteration)
        assert counted["target_ms_per_iteration"] > 0
        if burst["arm"] == "k0":
            assert counted["ngram_draft_tokens"] == counted["draft_model_draft_tokens"] == 0
    ratios = document["ratios"]
    assert [(r["phase"], r["round"]) for r in ratios] == [("1 stream", 0), ("2 streams", 0)]
    for row in ratios:
        assert row["adaptive/k0"] == pytest.approx(row["adaptive tok/s"] / row["k0 tok/s"])
    assert document["meta"]["noise_floor"] is None  # no k0-again arm
