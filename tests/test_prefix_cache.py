"""Prefix reuse across requests (specdec/loop/prefix_cache.py): the slot pool alone, then the
loop with scripted engines that keep real per-slot caches (tests/fakes.py), so a reused
prefix that is not what the slot holds gives wrong tokens."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeEngines, fake_decode, oracle_continuation
from specdec.loop.config import SchedulerConfig
from specdec.loop.prefix_cache import SlotPool, common_prefix_length
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState
from specdec.server_config import ServerConfig
from specdec.serving.settings import parse_prefix_cache, parse_prefix_min_tokens
from specdec.text.detokenizer import IncrementalDetokenizer
from specdec.text.request import GenerationRequest
from test_scheduler import request, run_all


def make_scheduler(num_slots=4, k=2, min_tokens: int | None = 4):
    engines = FakeEngines(num_slots)
    config = SchedulerConfig(
        num_slots,
        256,
        max_draft_tokens=8,
        default_draft_tokens=k,
        prefix_min_tokens=min_tokens,
    )
    return SpeculativeScheduler(engines, config, fake_decode), engines


def running_sequence(salt: str = "") -> SequenceState:
    """A running sequence as find() reads it: its request's salt (its slot and tokens come
    in find's tuple)."""
    detokenizer = IncrementalDetokenizer(fake_decode, [])
    return SequenceState(request(PROMPT, 1, cache_salt=salt), detokenizer, seed=0)


# -- the pool ---------------------------------------------------------------------------
def test_common_prefix_length():
    a = np.array([1, 2, 3, 4])
    assert common_prefix_length(a, np.array([1, 2, 9])) == 2
    assert common_prefix_length(a, np.array([1, 2])) == 2
    assert common_prefix_length(a, np.array([5])) == 0
    assert common_prefix_length(a, a) == 4


def test_free_slots_go_lowest_empty_first_then_least_recently_cached():
    pool = SlotPool(4, min_tokens=2)
    assert [pool.take() for _ in range(4)] == [0, 1, 2, 3]
    pool.give_back(2, [7, 7, 7], draft_length=3, salt="")
    pool.give_back(0, [8, 8, 8], draft_length=3, salt="")
    pool.give_back(3, [9], draft_length=1, salt="")  # shorter than min_tokens: kept empty
    assert pool.num_free == 3
    assert pool.take() == 3  # the empty one first
    assert pool.take() == 2  # then the least recently cached
    assert pool.counts.num_evictions == 1
    assert pool.find([8, 8, 8, 5], "") is not None  # slot 0's prefix is still there
    assert pool.find([7, 7, 7, 5], "") is None  # slot 2's was dropped


def test_the_longest_prefix_wins_and_a_tie_goes_to_a_free_slot():
    pool = SlotPool(4, min_tokens=2)
    for _ in range(4):
        pool.take()
    pool.give_back(1, [1, 2, 3], draft_length=2, salt="")
    pool.give_back(2, [1, 2, 3, 4, 5], draft_length=5, salt="")
    match = pool.find([1, 2, 3, 4, 6, 7], "")
    assert (match.slot, match.length, match.draft_length, match.running) == (2, 4, 4, False)
    # The prompt's last token is never reused: it is fed to make the first output token.
    match = pool.find([1, 2, 3, 4, 5], "")
    assert (match.slot, match.length) == (2, 4)
    # A running sequence with a longer prefix is copied from; with an equal one, the free
    # slot is adopted (nothing to copy).
    running = running_sequence()
    match = pool.find([1, 2, 3, 4, 5, 6, 7], "", [(0, [1, 2, 3, 4, 5, 6, 9], 6, running)])
    assert (match.slot, match.length, match.running) == (0, 6, True)
    match = pool.find([1, 2, 3, 4, 5, 6], "", [(0, [1, 2, 3, 4, 5, 6], 4, running)])
    assert (match.slot, match.length, match.running) == (2, 5, False)
    # Only what the running sequence's cache holds (its valid positions) counts.
    assert pool.find([5, 6, 9], "", [(0, [5, 6, 9, 9], 1, running)]) is None


def test_below_min_tokens_or_off_nothing_is_reused():
    pool = SlotPool(2, min_tokens=3)
    pool.take(), pool.take()
    pool.give_back(0, [1, 2, 3, 4], draft_length=4, salt="")
    assert pool.find([1, 2, 5, 6], "") is None  # 2 shared < 3
    assert pool.find([1, 2, 3, 9], "").length == 3
    off = SlotPool(2, min_tokens=None)
    off.take(), off.take()
    off.give_back(0, [1, 2, 3, 4], draft_length=4, salt="")
    assert off.find([1, 2, 3, 4, 5], "") is None and off.num_free == 1
    with pytest.raises(ValueError, match="prefix_min_tokens"):
        SlotPool(2, min_tokens=0)


def test_a_prefix_is_reused_only_under_the_salt_it_was_left_with():
    pool = SlotPool(4, min_tokens=2)
    for _ in range(4):
        pool.take()
    pool.give_back(1, [1, 2, 3, 4], draft_length=4, salt="tenant-a")
    running = [(0, [5, 6, 7, 8], 4, running_sequence("tenant-a"))]
    for prompt, slot in (([1, 2, 3, 9], 1), ([5, 6, 7, 9], 0)):  # cached, then running
        assert pool.find(prompt, "tenant-b", running) is None
        assert pool.find(prompt, "", running) is None  # no salt is a salt like any other
        assert pool.find(prompt, "tenant-a", running).slot == slot
    # The same tokens left under two salts: each finds its own.
    pool.give_back(2, [1, 2, 3, 4], draft_length=4, salt="tenant-b")
    assert pool.find([1, 2, 3, 9], "tenant-b").slot == 2
    assert pool.find([1, 2, 3, 9], "tenant-a").slot == 1


def test_forget_all_empties_the_cache():
    pool = SlotPool(2, min_tokens=1)
    pool.take(), pool.take()
    pool.give_back(1, [4, 4], draft_length=2, salt="")
    pool.forget_all()
    assert pool.find([4, 4, 4], "") is None and pool.num_free == 1
    assert pool.take() == 1 and pool.counts.num_evictions == 0


# -- the loop ---------------------------------------------------------------------------
PROMPT = [5, 3, 8, 1, 9, 2]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_next_turn_adopts_the_finished_turns_slot(temperature):
    """Turn 2 resends turn 1's prompt and answer: it adopts turn 1's slot and prefills only
    what is new; its output is what it is without reuse."""
    outputs = []
    for min_tokens in (4, None):
        scheduler, engines = make_scheduler(min_tokens=min_tokens)
        first = scheduler.submit(request(PROMPT, 10, temperature=temperature, seed=3))
        run_all(scheduler)
        second_prompt = first.token_ids + [4, 4]
        engines.input_lengths.clear()
        second = scheduler.submit(request(second_prompt, 12, temperature=temperature, seed=4))
        run_all(scheduler)
        outputs.append(second.token_ids[len(second_prompt) :])
        first_target = next(lengths for role, lengths in engines.input_lengths if role == "target")
        if min_tokens is None:
            assert second.num_copied_positions == 0
            assert first_target == [len(second_prompt) + 2]  # the whole prompt, and k = 2
        else:
            reused = len(first.token_ids) - 1  # all that turn 1's target cache held
            assert second.num_copied_positions == reused
            assert first_target == [len(second_prompt) - reused + 2]
            assert scheduler.snapshot().prefix_counts.num_hits == 1
            assert scheduler.snapshot().prefix_counts.num_reused_tokens == reused
            assert engines.copies == []  # adopted: nothing copied
    assert outputs[0] == outputs[1]
    if temperature == 0.0:
        assert outputs[0] == oracle_continuation(second_prompt, 12)


def test_a_prompt_that_shares_a_running_sequences_start_copies_it():
    scheduler, engines = make_scheduler(num_slots=4, k=2)
    long_runner = scheduler.submit(request(PROMPT + [7, 7], 30))
    scheduler.step()  # its prefill
    later = scheduler.submit(request(PROMPT + [6, 6, 6], 8))
    scheduler.step()
    shared = len(PROMPT)
    assert (long_runner.slot, later.slot, shared) in engines.copies
    assert later.num_copied_positions == shared
    run_all(scheduler)
    assert later.token_ids[len(PROMPT) + 3 :] == oracle_continuation(PROMPT + [6, 6, 6], 8)
    assert long_runner.token_ids[len(PROMPT) + 2 :] == oracle_continuation(PROMPT + [7, 7], 30)


def test_another_salt_reuses_nothing_from_a_cached_or_running_sequence():
    """The same prompt under another salt prefills in full, from a finished turn's cached
    slot as from a running sequence; under the same salt it starts from them."""
    scheduler, engines = make_scheduler(num_slots=4, k=2)
    first = scheduler.submit(request(PROMPT, 6, cache_salt="a"))
    run_all(scheduler)
    turn = first.token_ids + [4, 4]
    other, same = (scheduler.submit(request(turn, 6, cache_salt=s)) for s in ("b", "a"))
    run_all(scheduler)
    assert other.num_copied_positions == 0
    assert same.num_copied_positions == len(first.token_ids) - 1
    assert scheduler.snapshot().prefix_counts.num_hits == 1
    for sequence in (other, same):
        assert sequence.token_ids[len(turn) :] == oracle_continuation(turn, 6)

    runner = scheduler.submit(request(PROMPT + [7, 7], 30, cache_salt="r"))
    scheduler.step()  # its prefill
    other, same = (scheduler.submit(request(PROMPT + [6, 6], 8, cache_salt=s)) for s in "sr")
    scheduler.step()
    copied_into = {destination for _, destination, _ in engines.copies}
    assert other.slot not in copied_into and other.num_copied_positions == 0
    assert (runner.slot, same.slot, len(PROMPT)) in engines.copies
    assert scheduler.snapshot().prefix_counts.num_hits == 2


def test_cached_prefixes_never_make_a_request_wait():
    scheduler, _ = make_scheduler(num_slots=2, k=0)
    for first in (1, 2):
        scheduler.submit(request([first] * 6, 2))
    run_all(scheduler)
    assert scheduler.snapshot().num_free_slots == 2  # both slots hold a cached prefix
    unrelated = [scheduler.submit(request([t] * 6, 2)) for t in (3, 4)]
    scheduler.step()
    assert all(s.slot >= 0 for s in unrelated)  # both joined at once
    assert scheduler.snapshot().prefix_counts.num_evictions == 2
    run_all(scheduler)
    for s in unrelated:
        assert s.token_ids[6:] == oracle_continuation(s.request.prompt_ids, 2)


def test_after_an_engine_failure_nothing_is_reused():
    scheduler, engines = make_scheduler(num_slots=2, k=0)
    done = scheduler.submit(request(PROMPT, 3))
    run_all(scheduler)
    scheduler.fail_all()
    again = scheduler.submit(request(done.token_ids + [1], 3))
    run_all(scheduler)
    assert again.num_copied_positions == 0


def test_draft_caches_are_reused_too():
    """An adopted slot's draft cache holds the positions the sequence's draft_cache_length
    says (the fake asserts a call never claims more than the slot holds)."""
    scheduler, engines = make_scheduler(num_slots=2, k=3)
    first = scheduler.submit(request(PROMPT, 9))
    run_all(scheduler)
    slot = [s for s in range(2) if engines.target_cache[s][: len(PROMPT)] == PROMPT][0]
    second = scheduler.submit(request(first.token_ids + [2], 6))
    scheduler.step()
    assert second.slot == slot
    assert engines.draft_cache[slot][: len(first.token_ids) - 1] == first.token_ids[:-1]
    run_all(scheduler)
    assert second.token_ids[len(first.token_ids) + 1 :] == oracle_continuation(
        first.token_ids + [2], 6
    )


def test_request_with_prompt_only_one_token_long_is_served():
    scheduler, _ = make_scheduler(min_tokens=1)
    a = scheduler.submit(request([4], 3))
    run_all(scheduler)
    b = scheduler.submit(GenerationRequest(prompt=None, prompt_ids=[4], max_tokens=3, end_id=-1))
    run_all(scheduler)
    assert a.token_ids == b.token_ids


# -- settings ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env",
    [{"PREFIX_CACHE": "maybe"}, {"PREFIX_MIN_TOKENS": "0"}, {"PREFIX_MIN_TOKENS": "many"}],
)
def test_a_bad_prefix_setting_is_refused_before_the_server_starts(env):
    (name,) = env
    with pytest.raises(ValueError, match=name):
        ServerConfig.from_env(env)


def test_prefix_settings_reach_the_loops_config():
    config = ServerConfig.from_env({"PREFIX_CACHE": "off", "PREFIX_MIN_TOKENS": "32"})
    bls = config.parameters["speculative_decoding"]
    assert (bls["prefix_cache"], bls["prefix_min_tokens"]) == ("off", "32")
    assert parse_prefix_cache("x", "on") and not parse_prefix_cache("x", "off")
    assert parse_prefix_min_tokens("x", " 48 ") == 48


# -- long prompts join in chunks ----------------------------------------------------------
def chunked_scheduler(num_slots=4, k=2, chunk: int | None = 8):
    engines = FakeEngines(num_slots)
    config = SchedulerConfig(
        num_slots, 512, max_draft_tokens=8, default_draft_tokens=k, prefill_chunk=chunk
    )
    return SpeculativeScheduler(engines, config, fake_decode), engines


@pytest.mark.parametrize("k", [0, 3])
def test_a_long_prompt_joins_in_chunks_while_the_running_rows_go_on(k):
    scheduler, engines = chunked_scheduler(k=k)
    runner = scheduler.submit(request([2, 4], 40))
    scheduler.step()
    long_prompt = [(7 * i + 3) % 50 for i in range(30)]
    joiner = scheduler.submit(request(long_prompt, 6))
    for _ in range(3):  # 30 tokens: chunks of 8, 8, 8 (one budget per step), then 6 whole
        before = runner.num_output_tokens
        scheduler.step()
        assert runner.num_output_tokens > before  # the running row emitted in every step
        assert joiner.num_output_tokens == 0
    assert engines.input_lengths[-1] == ("target", [1 + k, 8])
    assert joiner.target_cache_length == 24
    scheduler.step()
    assert joiner.num_output_tokens >= 1
    run_all(scheduler)
    assert joiner.token_ids[30:] == oracle_continuation(long_prompt, 6)
    assert runner.token_ids[2:] == oracle_continuation([2, 4], 40)


def test_prefill_chunks_share_one_budget_per_step():
    scheduler, engines = chunked_scheduler(k=0)
    prompts = [[(5 * i + j) % 50 for i in range(20)] for j in (1, 2)]
    first, second = (scheduler.submit(request(p, 3)) for p in prompts)
    scheduler.step()
    # 8 tokens of budget: the first takes them all; the second sits the step out.
    assert engines.input_lengths[-1] == ("target", [8])
    run_all(scheduler)
    for sequence, prompt in zip((first, second), prompts, strict=True):
        assert sequence.token_ids[20:] == oracle_continuation(prompt, 3)


def test_without_chunks_a_long_prompt_prefills_in_its_first_step():
    scheduler, engines = chunked_scheduler(k=0, chunk=None)
    scheduler.submit(request(list(range(30)), 2))
    scheduler.step()
    assert engines.input_lengths[-1] == ("target", [30])
