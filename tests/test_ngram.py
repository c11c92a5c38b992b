"""Prompt lookup (specdec/loop/proposers/ngram.py) and its use by the loop, with scripted
engines."""

from __future__ import annotations

import random

import pytest

import fakes
from fakes import FakeEngines, copying_oracle, fake_decode
from specdec.loop.config import SchedulerConfig
from specdec.loop.proposers.ngram import NgramIndex
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.timing import StepTimer
from specdec.text.request import GenerationRequest


def brute_force(tokens: list[int], max_tokens: int, lengths=(3, 2, 1)) -> list[int]:
    for n in lengths:
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest occurrence with a follower
            if tokens[end - n : end] == suffix:
                return tokens[end : end + max_tokens]
    return []


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # 3-gram match
        ([1, 2, 3, 4, 9, 2, 3], 4, [4, 9, 2, 3]),  # 2-gram: the 3-gram (9, 2, 3) is new
        ([5, 6, 7, 5, 8, 5], 2, [8, 5]),  # the latest of two 1-gram matches
        ([1, 2, 3], 4, []),  # nothing repeats
        ([1, 2, 1, 2], 0, []),
        ([4, 4, 4, 4], 8, [4]),  # only one token follows the latest match
    ],
)
def test_propose_takes_the_longest_latest_match(tokens, max_tokens, expected):
    assert NgramIndex().propose(tokens, max_tokens) == expected


def test_incremental_index_agrees_with_a_scan():
    rng = random.Random(3)
    for _ in range(20):
        index, tokens = NgramIndex(), [rng.randrange(6) for _ in range(3)]
        for _ in range(60):
            assert index.propose(tokens, 5) == brute_force(tokens, 5)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def repeat(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(copying_oracle(tokens))
    return tokens[len(prompt) :]


def make_scheduler(default_k=None, proposers=("draft_model", "ngram")):
    config = SchedulerConfig(
        4, 256, max_draft_tokens=8, default_draft_tokens=default_k, proposer_names=proposers
    )
    engines = FakeEngines(4)
    return SpeculativeScheduler(engines, config, fake_decode), engines


def run_all(scheduler, limit=2_000):
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.step()
    raise AssertionError("loop did not finish")


PROMPT = [11, 12, 13, 14, 15, 16, 17]


def test_lookup_drafts_copied_text_without_the_draft_model(monkeypatch):
    monkeypatch.setattr(fakes, "oracle_next", copying_oracle)
    scheduler, engines = make_scheduler()
    request = GenerationRequest(None, PROMPT, 60, end_id=-1, proposers=("ngram",))
    sequence = scheduler.submit(request)
    run_all(scheduler)
    assert sequence.token_ids[len(PROMPT) :] == repeat(PROMPT, 60)
    assert not any(role == "draft" for role, _ in engines.calls)
    # A perfect copy: after the cost curve is known, most tokens come from lookups.
    assert sequence.stats.num_accepted_draft_tokens >= 30
    assert sequence.stats.num_target_passes < 30


@pytest.mark.parametrize(("host_seconds_per_token", "pays"), [(0.0, True), (0.012, False)])
def test_lookups_are_priced_by_whole_iterations(monkeypatch, host_seconds_per_token, pays):
    # The target call costs 10 ms + 0.5 ms per token: by it alone every lookup token pays.
    # When the loop's own work costs 12 ms per proposed token, no lookup pays, and after one
    # measured try the loop stops proposing (but for the occasional probe).
    monkeypatch.setattr(fakes, "oracle_next", copying_oracle)
    clock = [0.0]
    scheduler, engines = make_scheduler()
    scheduler.engines.clock = lambda: clock[0]
    timer = StepTimer(scheduler, clock=lambda: clock[0])
    fake_target, build_target_batch = engines.target, scheduler._target_batch

    def target(batch):
        clock[0] += 0.010 + 0.0005 * len(batch.input_ids)
        return fake_target(batch)

    def target_batch(work, proposals):
        clock[0] += host_seconds_per_token * sum(len(p.token_ids) for p in proposals.values())
        return build_target_batch(work, proposals)

    monkeypatch.setattr(engines, "target", target)
    monkeypatch.setattr(scheduler, "_target_batch", target_batch)
    sequence = scheduler.submit(
        GenerationRequest(None, PROMPT, 200, end_id=-1, proposers=("ngram",))
    )
    steps = proposing = 0
    while scheduler.has_work:
        result = timer.step()
        steps += 1
        proposing += result.stats.num_draft_tokens > 0
    assert sequence.token_ids[len(PROMPT) :] == repeat(PROMPT, 200)
    if pays:
        assert proposing > steps / 2
    else:
        assert steps > 150 and proposing <= steps / 8


def test_exact_lookup_k_and_greedy_exactness_on_text_that_does_not_copy():
    # The default oracle rarely repeats: lookups are mostly rejected, output stays exact.
    scheduler, _ = make_scheduler()
    sequences = [
        scheduler.submit(
            GenerationRequest(
                None,
                [i + 1, 2 * i + 3],
                40,
                end_id=-1,
                proposers=("ngram",),
                num_draft_tokens=4,
                fixed_num_draft_tokens=True,
            )
        )
        for i in range(3)
    ]
    run_all(scheduler)
    for i, sequence in enumerate(sequences):
        assert sequence.token_ids[2:] == fakes.oracle_continuation([i + 1, 2 * i + 3], 40)
        assert sequence.stats.num_draft_tokens > 0  # it did propose where it matched


def test_rows_choose_their_own_proposer(monkeypatch):
    # A copying row uses lookups; a row restricted to the draft model never does.
    monkeypatch.setattr(fakes, "oracle_next", copying_oracle)
    scheduler, _ = make_scheduler()
    copier = scheduler.submit(GenerationRequest(None, PROMPT, 60, end_id=-1))
    drafted = scheduler.submit(
        GenerationRequest(
            None,
            [1, 2, 3, 4, 5, 6, 7],
            60,
            end_id=-1,
            proposers=("draft_model",),
            num_draft_tokens=2,
        )
    )
    seen = {copier.id: set(), drafted.id: set()}
    while scheduler.has_work:
        plan = scheduler.step().plan
        for s in (copier, drafted):
            seen[s.id].add(plan.of(s)[0])
    assert "ngram" in seen[copier.id]
    assert "ngram" not in seen[drafted.id]
    assert copier.token_ids[len(PROMPT) :] == repeat(PROMPT, 60)
    assert drafted.token_ids[7:] == repeat([1, 2, 3, 4, 5, 6, 7], 60)


def test_num_draft_tokens_caps_the_lookup(monkeypatch):
    # Copied text: lookups pay and would take up to max_draft_tokens (8); the request caps 2.
    monkeypatch.setattr(fakes, "oracle_next", copying_oracle)
    scheduler, _ = make_scheduler()
    sequence = scheduler.submit(GenerationRequest(None, PROMPT, 30, end_id=-1, num_draft_tokens=2))
    ks, lookups = [], [0, 0]  # k per step; the lookups' [proposed, accepted]
    while scheduler.has_work:
        result = scheduler.step()
        ks.append(result.plan.of(sequence)[1])
        proposed, accepted = result.stats.by_proposer.get("ngram", [0, 0])
        lookups = [lookups[0] + proposed, lookups[1] + accepted]
    assert max(ks) == 2, ks
    assert lookups[0] >= 10 and lookups[1] == lookups[0], lookups  # copies are all accepted
    assert sequence.token_ids[len(PROMPT) :] == repeat(PROMPT, 30)


def test_zero_draft_tokens_turns_speculation_off(monkeypatch):
    monkeypatch.setattr(fakes, "oracle_next", copying_oracle)
    scheduler, engines = make_scheduler()
    sequence = scheduler.submit(GenerationRequest(None, PROMPT, 30, end_id=-1, num_draft_tokens=0))
    run_all(scheduler)
    assert sequence.stats.num_draft_tokens == 0
    assert not any(role == "draft" for role, _ in engines.calls)
