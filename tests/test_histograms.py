"""The latency and size histograms in plain Python (specdec/serving/histograms.py): bucket
placement as Prometheus counts it (le: value <= bound), cumulative increments per take, and
what the loop's sequences observe, against the scheduler's own times. Pure: no server."""

from __future__ import annotations

import itertools
import math

import pytest

from fakes import FakeEngines, fake_decode
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.serving.histograms import BucketCounts, SequenceHistograms, check_bounds
from specdec.serving.metric_names import (
    END_TO_END_LATENCY,
    HISTOGRAMS,
    INPUT_TOKENS,
    INTER_TOKEN_LATENCY,
    OUTPUT_TOKENS,
    QUEUE_TIME,
    TIME_TO_FIRST_TOKEN,
)
from specdec.text.request import GenerationRequest

NS = 1e-9


@pytest.mark.parametrize(
    ("value", "bucket"),
    [(0.0, 0), (1.0, 0), (1.0000001, 1), (2.0, 1), (4.9, 2), (5.0, 2), (5.1, 3), (1e9, 3)],
)
def test_a_value_counts_in_the_first_bucket_whose_bound_it_does_not_exceed(value, bucket):
    counts = BucketCounts("h", (1.0, 2.0, 5.0))
    counts.observe(value)
    taken = counts.take()
    # Cumulative: that bucket and every one above it (+Inf last) grew by one.
    assert taken.buckets == [0] * bucket + [1] * (4 - bucket)
    assert taken.sum == value and taken.count == 1


def test_take_hands_over_increments_once():
    counts = BucketCounts("h", (1.0, 2.0, 5.0))
    counts.observe(0.5, times=3)
    counts.observe(3.0)
    counts.observe(7.0, times=2)
    counts.observe(9.0, times=0)  # no observation
    taken = counts.take()
    assert taken.buckets == [3, 3, 4, 6]
    assert taken.count == 6 and taken.sum == pytest.approx(0.5 * 3 + 3.0 + 14.0)
    again = counts.take()
    assert again.buckets == [0, 0, 0, 0] and again.count == 0 and again.sum == 0.0


@pytest.mark.parametrize(
    ("bounds", "why"),
    [((), "none given"), ((1.0, math.inf), "not all finite"), ((1.0, 1.0), "increasing")],
)
def test_bad_buckets_are_refused_naming_the_histogram(bounds, why):
    with pytest.raises(ValueError, match=f"my_hist: buckets: .*{why}"):
        check_bounds("my_hist", bounds)


def test_the_declared_buckets_are_valid():
    assert len(HISTOGRAMS) == 6
    for family in HISTOGRAMS:
        check_bounds(family.name, family.buckets)


def make_scheduler(num_slots: int, k: int, clock) -> SpeculativeScheduler:
    engines = FakeEngines(num_slots)
    config = SchedulerConfig(
        num_slots, 256, max_draft_tokens=8, default_draft_tokens=k, max_queue=64
    )
    return SpeculativeScheduler(engines, config, fake_decode, clock=clock)


def test_the_loop_s_sequences_observe_what_their_times_say():
    """Six sequences through the real scheduler (scripted engines, a clock that moves 1 ms
    at every read), two slots so that four wait, k = 3 so that iterations commit several
    tokens: each histogram's count and sum equal what the sequences' own times and lengths
    give, and the inter-token latencies sum to last - first token per sequence."""
    clock = itertools.count(1_000_000_000, 1_000_000).__next__  # ns
    scheduler = make_scheduler(num_slots=2, k=3, clock=clock)
    prompts = [[i + 1, 2 * i + 3, 5] * (i + 1) for i in range(6)]
    sequences = [
        scheduler.submit(GenerationRequest(None, prompt_ids=p, max_tokens=9 + i, end_id=-1))
        for i, p in enumerate(prompts)
    ]
    histograms = SequenceHistograms()
    multi_token_commits = 0
    while scheduler.has_work:
        result = scheduler.step()
        now_ns = clock()
        for update in result.updates:
            histograms.tokens_committed(update.sequence, update.num_emitted)
            multi_token_commits += update.num_emitted > 1
            if update.finished:
                histograms.finished(update.sequence, now_ns)
                assert update.sequence.times.arrival_ns < now_ns
    assert multi_token_commits > 0  # the spreading rule ran
    taken = histograms.take()
    times = [s.times for s in sequences]
    assert all(t.first_scheduled_ns > t.arrival_ns for t in times[2:])  # some waited

    def check(name, count, total):
        assert taken[name].count == count, name
        assert taken[name].sum == pytest.approx(total, rel=1e-9), name
        assert taken[name].buckets[-1] == count, name  # +Inf holds every observation

    check(TIME_TO_FIRST_TOKEN, 6, sum((t.first_token_ns - t.arrival_ns) * NS for t in times))
    check(QUEUE_TIME, 6, sum((t.first_scheduled_ns - t.arrival_ns) * NS for t in times))
    num_output = [s.num_output_tokens for s in sequences]
    assert num_output == [9 + i for i in range(6)]
    check(
        INTER_TOKEN_LATENCY,
        sum(n - 1 for n in num_output),
        sum((t.last_token_ns - t.first_token_ns) * NS for t in times),
    )
    check(OUTPUT_TOKENS, 6, sum(num_output))
    check(INPUT_TOKENS, 6, sum(len(p) for p in prompts))
    assert taken[END_TO_END_LATENCY].count == 6
    assert taken[END_TO_END_LATENCY].sum > sum((t.last_token_ns - t.arrival_ns) * NS for t in times)


def test_tokens_of_one_commit_share_its_gap():
    """A sequence's commits of 1, then 4, then 2 tokens: its first is the time to first
    token, then 1 gap of 30 ms, then 4 of 100 / 4 ms, then 2 of 10 / 2 ms."""
    scheduler = make_scheduler(num_slots=1, k=0, clock=itertools.count(0, 1_000_000).__next__)
    sequence = scheduler.submit(GenerationRequest(None, prompt_ids=[1, 2], max_tokens=20))
    times = sequence.times
    histograms = SequenceHistograms()
    commits = [(1, 20_000_000), (1, 50_000_000), (4, 150_000_000), (2, 160_000_000)]
    times.arrival_ns, times.first_scheduled_ns = 0, 5_000_000
    for num_emitted, at in commits:
        sequence.token_ids += [7] * num_emitted
        times.first_token_ns = times.first_token_ns or at
        times.previous_token_ns, times.last_token_ns = times.last_token_ns, at
        histograms.tokens_committed(sequence, num_emitted)
    taken = histograms.take()
    assert taken[TIME_TO_FIRST_TOKEN].sum == pytest.approx(0.020)
    assert taken[QUEUE_TIME].sum == pytest.approx(0.005)
    itl = taken[INTER_TOKEN_LATENCY]
    assert itl.count == 7 and itl.sum == pytest.approx(0.140)
    # Bounds 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, ...: 5 ms twice (le 0.005), 25 ms four
    # times (le 0.04), 30 ms once (le 0.04).
    bounds = dict(zip(HISTOGRAMS[1].buckets, itl.buckets, strict=False))
    assert HISTOGRAMS[1].name == INTER_TOKEN_LATENCY
    assert bounds[0.0025] == 0 and bounds[0.005] == 2 and bounds[0.02] == 2
    assert bounds[0.04] == 7


def test_a_first_commit_of_several_tokens_observes_zeros_after_the_first():
    scheduler = make_scheduler(num_slots=1, k=0, clock=itertools.count(0, 1_000_000).__next__)
    sequence = scheduler.submit(GenerationRequest(None, prompt_ids=[1, 2], max_tokens=20))
    sequence.token_ids += [7, 8, 9]
    sequence.times.first_token_ns = sequence.times.last_token_ns = 40_000_000
    histograms = SequenceHistograms()
    histograms.tokens_committed(sequence, 3)
    histograms.tokens_committed(sequence, 0)  # a row that emitted nothing observes nothing
    taken = histograms.take()
    assert taken[TIME_TO_FIRST_TOKEN].count == 1
    assert taken[INTER_TOKEN_LATENCY].count == 2 and taken[INTER_TOKEN_LATENCY].sum == 0.0
    assert taken[INTER_TOKEN_LATENCY].buckets[0] == 2  # le 0.001
    assert taken[OUTPUT_TOKENS].count == 0  # not finished


@pytest.mark.parametrize("reason", ["cancelled", "error", "shutdown", None])
def test_only_a_normal_end_observes_latency_and_tokens(reason):
    scheduler = make_scheduler(num_slots=1, k=0, clock=itertools.count(0, 1_000_000).__next__)
    sequence = scheduler.submit(GenerationRequest(None, prompt_ids=[1, 2], max_tokens=20))
    histograms = SequenceHistograms()
    sequence.finish_reason = reason
    histograms.finished(sequence, 10**9)
    sequence.finish_reason = "stop"
    histograms.finished(sequence, 10**9)
    taken = histograms.take()
    for name in (END_TO_END_LATENCY, INPUT_TOKENS, OUTPUT_TOKENS):
        assert taken[name].count == 1, name
