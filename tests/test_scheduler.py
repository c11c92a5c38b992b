"""The in-flight batching loop with scripted engines (tests/fakes.py: real per-slot caches)."""

from __future__ import annotations

import pytest
import torch

import fakes
from fakes import FakeEngines, fake_decode, oracle_continuation
from specdec.loop.admission import QueueFull
from specdec.loop.config import SchedulerConfig
from specdec.loop.economics import Choice, StepShape
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.timing import StepTimer
from specdec.text.request import GenerationRequest
from stats import chi_square, critical_0_001


def make_scheduler(num_slots=4, k=3, max_context=256, fail_on_call=None, max_queue=64):
    engines = FakeEngines(num_slots, fail_on_call)
    config = SchedulerConfig(
        num_slots, max_context, max_draft_tokens=8, default_draft_tokens=k, max_queue=max_queue
    )
    return SpeculativeScheduler(engines, config, fake_decode), engines


def request(prompt, max_tokens, **kw) -> GenerationRequest:
    kw.setdefault("end_id", -1)
    if "proposer" in kw:  # one proposer's name, as the tests below write it
        kw["proposers"] = (kw.pop("proposer"),)
    return GenerationRequest(prompt=None, prompt_ids=list(prompt), max_tokens=max_tokens, **kw)


def run_all(scheduler, limit=10_000, timer=None):
    """Steps until every request is done (through `timer`, a StepTimer, if given)."""
    step = timer.step if timer is not None else scheduler.step
    updates = []
    for _ in range(limit):
        if not scheduler.has_work:
            return updates
        updates += step().updates
    raise AssertionError("loop did not finish")


@pytest.mark.parametrize("k", [0, 1, 3, 8])
def test_outputs_equal_target_greedy_at_every_k(k):
    scheduler, _ = make_scheduler(k=k)
    sequences = [scheduler.submit(request([i + 1, 2 * i + 3], 20 + 5 * i)) for i in range(6)]
    run_all(scheduler)
    for i, s in enumerate(sequences):
        assert s.token_ids[2:] == oracle_continuation([i + 1, 2 * i + 3], 20 + 5 * i)
        assert s.finish_reason == "length"


def test_requests_join_and_leave_at_step_boundaries():
    scheduler, engines = make_scheduler(num_slots=2, k=2)
    first = scheduler.submit(request([1], 4))
    second = scheduler.submit(request([2], 30))
    third = scheduler.submit(request([3], 6))  # waits for a slot
    assert [s.id for s in scheduler.step().snapshot.running] == [first.id, second.id]
    assert third.slot == -1
    run_all(scheduler)
    assert third.token_ids[1:] == oracle_continuation([3], 6)
    # One draft call and one target call per step, never more rows than slots.
    assert max(size for _, size in engines.calls) <= 2
    assert scheduler.snapshot().num_free_slots == 2


def test_each_request_keeps_its_own_k():
    scheduler, engines = make_scheduler(k=4)
    plain = scheduler.submit(request([5], 12, num_draft_tokens=0))
    spec = scheduler.submit(request([6], 12, num_draft_tokens=2, fixed_num_draft_tokens=True))
    run_all(scheduler)
    assert plain.stats.num_draft_tokens == 0
    assert plain.stats.num_target_passes == 12
    assert spec.stats.num_draft_tokens > 0
    assert spec.token_ids[1:] == oracle_continuation([6], 12)


def test_end_token_stops_and_is_not_emitted():
    expected = oracle_continuation([4, 4], 30)
    end_id = expected[10]
    first_end = expected.index(end_id)
    scheduler, _ = make_scheduler()
    s = scheduler.submit(
        request([4, 4], 30, end_id=end_id, num_draft_tokens=3, fixed_num_draft_tokens=True)
    )
    run_all(scheduler)
    assert s.finish_reason == "end"
    assert s.token_ids[2:] == expected[:first_end]


def test_an_end_token_among_accepted_draft_tokens_ends_the_row(monkeypatch):
    """With a draft that is always right, an end token mostly arrives as an accepted draft
    token, not as the verdict's last one: it still ends the row there, at every position."""
    monkeypatch.setattr(fakes, "draft_guess", fakes.oracle_next)
    expected = oracle_continuation([4, 4], 30)
    for position in range(1, 12):
        end_id = expected[position]
        scheduler, _ = make_scheduler()
        s = scheduler.submit(
            request([4, 4], 30, end_id=end_id, num_draft_tokens=4, fixed_num_draft_tokens=True)
        )
        run_all(scheduler)
        assert s.finish_reason == "end"
        assert s.token_ids[2:] == expected[: expected.index(end_id)]
        assert s.stats.num_accepted_draft_tokens == s.stats.num_draft_tokens  # always right


def test_stop_word_ends_generation_with_the_word_included():
    expected = oracle_continuation([9], 40)
    text = fake_decode(expected)
    stop = text[12:15]
    scheduler, _ = make_scheduler()
    s = scheduler.submit(request([9], 40, stop_words=[stop]))
    run_all(scheduler)
    assert s.finish_reason == "stop"
    assert s.detokenizer.text == text[: text.index(stop) + len(stop)]


def test_context_limit_ends_generation():
    scheduler, _ = make_scheduler(max_context=16, k=4)
    s = scheduler.submit(request(list(range(10)), 100))
    run_all(scheduler)
    assert s.finish_reason == "length"
    assert len(s.token_ids) == 17  # the 16 cached positions + the last token


def test_cancel_frees_the_slot_at_the_next_step():
    scheduler, _ = make_scheduler(num_slots=2)
    a = scheduler.submit(request([1], 50))
    b = scheduler.submit(request([2], 10))
    scheduler.step()
    scheduler.cancel(a)
    result = scheduler.step()
    assert a.finish_reason == "cancelled"
    assert a.slot == -1
    assert a not in result.snapshot.running
    run_all(scheduler)
    assert b.token_ids[1:] == oracle_continuation([2], 10)


def test_engine_failure_ends_every_request_and_the_loop_goes_on():
    scheduler, _ = make_scheduler(fail_on_call=3)
    running = [scheduler.submit(request([i], 20)) for i in range(3)]
    with pytest.raises(RuntimeError, match="scripted"):
        run_all(scheduler)
    ended = scheduler.fail_all()
    assert {s.id for s in ended} == {s.id for s in running}
    assert scheduler.snapshot().num_free_slots == 4
    after = scheduler.submit(request([7], 8))
    run_all(scheduler)
    assert after.token_ids[1:] == oracle_continuation([7], 8)


def test_queue_is_bounded():
    scheduler, _ = make_scheduler(num_slots=4, max_queue=2)
    for i in range(6):  # 4 will have slots at the next step, 2 wait
        scheduler.submit(request([i], 5))
    with pytest.raises(QueueFull):
        scheduler.submit(request([9], 5))


def test_streamed_chunks_join_to_the_final_text():
    scheduler, _ = make_scheduler(k=3)
    scheduler.submit(request([3, 1], 25, stream=True))
    chunks = [u.text for u in run_all(scheduler)]
    assert "".join(chunks) == fake_decode(oracle_continuation([3, 1], 25))


def test_rows_with_their_own_k_are_booked_as_what_they_cost():
    # A batch of requests that fix k = 4 runs with the draft's adaptive k at 0; its
    # iterations must be measured as k = 4 iterations, not as what plain decoding costs.
    scheduler, _ = make_scheduler(k=None)
    timer = StepTimer(scheduler)
    for i in range(2):
        scheduler.submit(request([i + 1], 30, num_draft_tokens=4, fixed_num_draft_tokens=True))
    run_all(scheduler, timer=timer)
    costs = scheduler.economics.costs
    assert set(costs.iterations) == {(2, 4)}  # two rows, a 4-step draft call
    assert costs.measured(StepShape(2, 10, 1, 4)) is not None
    scheduler.submit(request([9], 30))  # adaptive, alone: plain decoding, measured
    run_all(scheduler, timer=timer)
    assert costs.measured(StepShape(1, 1, 1, None)) is not None


def test_the_plan_is_a_value_made_without_an_engine():
    # Plan, execute, commit: planning reads the rows and the cost model and calls nothing;
    # the plan then runs as it says.
    scheduler, engines = make_scheduler(k=2)
    sequences = [scheduler.submit(request([i + 1, 5, 6], 20)) for i in range(3)]
    scheduler.step()  # the prompts' prefill
    calls = list(engines.calls)
    work = scheduler.plan()
    assert work is not None and engines.calls == calls  # no engine ran
    assert work.steady and work.plan.batch == sequences and work.plan.ks == [2, 2, 2]
    assert work.plan.calls == {"draft_model": [0, 1, 2]}
    execution = scheduler.execute(work)
    assert engines.calls[len(calls) :] == [("draft", 3), ("target", 3)]
    updates, verdicts = scheduler.commit(work, execution)
    assert [u.sequence for u in updates] == sequences and len(verdicts) == 3
    run_all(scheduler)
    for i, sequence in enumerate(sequences):
        assert sequence.token_ids[3:] == oracle_continuation([i + 1, 5, 6], 20)


def test_a_step_that_prefills_is_not_booked_as_a_decode_step():
    # A joining prompt's step costs its prefill: neither its target call nor its whole cost
    # may price a decode step of that many tokens.
    scheduler, _ = make_scheduler(k=0)
    timer = StepTimer(scheduler)
    scheduler.submit(request(list(range(1, 21)), 6))  # a prompt of 20 tokens
    run_all(scheduler, timer=timer)
    costs = scheduler.economics.costs
    assert 20 not in costs.target.sizes and costs.target.sizes == [1]
    assert list(costs.iterations[(1, None)].sizes) == [1]


def test_waiting_for_the_next_request_is_no_iterations_cost(monkeypatch):
    # At one stream the loop idles between a request's end and the client's next one. Booked
    # as the last iteration's cost, that wait made k = 0 look dearer than it was. Nor is a
    # gap of several steps' length while requests run (the process held up).
    clock = [0.0]

    class TimedEngines(FakeEngines):
        def target(self, batch):
            clock[0] += 0.010
            return super().target(batch)

    engines = TimedEngines(4)
    config = SchedulerConfig(4, 256, max_draft_tokens=8, default_draft_tokens=None)
    scheduler = SpeculativeScheduler(engines, config, fake_decode)
    timer = StepTimer(scheduler, clock=lambda: clock[0])
    scheduler.submit(request([1], 30))
    run_all(scheduler, timer=timer)
    clock[0] += 0.015  # the client's round trip: shorter than three steps
    scheduler.submit(request([2], 30))
    for _ in range(4):
        timer.step()
    clock[0] += 0.5  # the loop held up between two steps (not the step's own cost)
    run_all(scheduler, timer=timer)
    curves = scheduler.economics.costs.iterations.values()
    booked = [seconds for curve in curves for seconds in curve.seconds.values()]
    assert booked and all(s == pytest.approx(0.010) for s in booked)


def test_a_probe_scores_the_drafts_guesses_of_plain_tokens_without_a_verify(monkeypatch):
    # Plain decoding for 20 steps, then one probe: the draft catches up (proposing nothing),
    # its guesses of the 20 output tokens are first-position verdicts, and the target call
    # verifies nothing extra.
    engines = FakeEngines(4)
    target_steps = []
    target = engines.target

    def recording_target(batch):
        target_steps.append(batch.num_steps.tolist())
        return target(batch)

    engines.target = recording_target
    config = SchedulerConfig(4, 256, max_draft_tokens=8, default_draft_tokens=None)
    scheduler = SpeculativeScheduler(engines, config, fake_decode)
    planner = scheduler.economics.model_planners["draft_model"]
    sequence = scheduler.submit(request([5, 6, 7], 40))
    monkeypatch.setattr(planner, "choose", lambda n, others: Choice(0))
    for _ in range(20):
        scheduler.step()
    assert sequence.num_output_tokens == 20 and not any(r == "draft" for r, _ in engines.calls)
    monkeypatch.setattr(planner, "choose", lambda n, others: Choice(0, probe=True))
    scheduler.step()
    assert engines.calls[-2:] == [("draft", 1), ("target", 1)]
    assert target_steps[-1] == [1]
    # The fake draft misses tokens at lengths divisible by 3: 7 of the outputs at 3..22.
    window = planner.acceptance
    assert window.tried[0] == pytest.approx((1 - window.decay**20) / (1 - window.decay))
    assert window.accepted[0] / window.tried[0] == pytest.approx(13 / 20)
    assert sequence.draft_cache_length == len(sequence.token_ids) - 1  # caught up
    monkeypatch.undo()
    run_all(scheduler)
    assert sequence.token_ids[3:] == oracle_continuation([5, 6, 7], 40)


def test_return_sequences_prefill_once_and_copy_the_prompt_cache():
    scheduler, engines = make_scheduler(num_slots=4, k=2)
    prompt = [4, 9, 11, 2, 7]
    group = scheduler.submit_all([request(prompt, 12, num_return_sequences=3)])
    assert [s.sequence_index for s in group] == [0, 1, 2]
    updates = run_all(scheduler)
    for s in group:  # greedy: each equals target greedy decoding
        assert s.token_ids[len(prompt) :] == oracle_continuation(prompt, 12)
    # The prompt went through the target once (with k = 2 proposals); the copies fed only
    # its last token, with theirs.
    first_target = [lengths for role, lengths in engines.input_lengths if role == "target"][:2]
    assert first_target[0] == [len(prompt) + 2]
    assert first_target[1][1:] == [1 + 2, 1 + 2]
    # From the parent's slot (0, the lowest) into the others, in both engines.
    assert sorted(engines.copies) == [(0, 1, 4), (0, 1, 4), (0, 2, 4), (0, 2, 4)]
    assert all(s.num_copied_positions == len(prompt) - 1 for s in group[1:])
    assert group[0].num_copied_positions == 0
    assert sum(u.finished for u in updates) == 3


def test_copies_wait_for_the_parents_prefill_and_survive_its_end():
    """A parent that ends at its prefill step (max_tokens 1) frees its slot; the copies,
    made at the start of the next call, still read the prompt from it."""
    scheduler, engines = make_scheduler(num_slots=3, k=0)
    prompt = [3, 5, 8]
    first, second = scheduler.submit_all([request(prompt, 1, num_return_sequences=2)])
    scheduler.step()
    assert first.finish_reason == "length" and second.num_output_tokens == 0
    run_all(scheduler)
    assert second.token_ids[3:] == oracle_continuation(prompt, 1)
    assert engines.copies[0][2] == len(prompt) - 1


def test_a_batch_of_prompts_runs_as_rows_of_their_own():
    scheduler, _ = make_scheduler(num_slots=4, k=2)
    prompts = [[1, 2], [3], [4, 5, 6]]
    requests = [request(p, 10 + i) for i, p in enumerate(prompts)]
    for i, r in enumerate(requests):
        r.batch_index = i
    sequences = scheduler.submit_all(requests)
    run_all(scheduler)
    for i, (p, s) in enumerate(zip(prompts, sequences, strict=True)):
        assert s.request.batch_index == i and s.sequence_index == 0
        assert s.token_ids[len(p) :] == oracle_continuation(p, 10 + i)


def test_a_request_group_is_queued_whole_or_not_at_all():
    scheduler, _ = make_scheduler(num_slots=1, max_queue=2)
    with pytest.raises(QueueFull):
        scheduler.submit_all([request([1], 5, num_return_sequences=4)])
    assert scheduler.snapshot().num_waiting == 0
    scheduler.submit_all([request([1], 5, num_return_sequences=3)])
    assert scheduler.snapshot().num_waiting == 3


@pytest.mark.parametrize("k", [0, 4])
def test_log_probs_are_the_targets_and_do_not_depend_on_k(k):
    scheduler, _ = make_scheduler(k=k)
    s = scheduler.submit(request([2, 7], 25, return_log_probs=True))
    run_all(scheduler)
    output = s.token_ids[2:]
    assert s.output_log_probs == pytest.approx([-0.01 * (t + 1) for t in output])


def test_times_are_ordered_and_come_from_the_clock():
    scheduler, _ = make_scheduler(k=2)
    ticks = iter(range(1000, 100_000, 10))
    scheduler.admission.clock = lambda: next(ticks)
    s = scheduler.submit(request([1, 2], 9))
    run_all(scheduler)
    times = s.times
    assert 0 < times.arrival_ns < times.first_scheduled_ns < times.first_token_ns
    assert times.first_token_ns < times.last_token_ns


def target_law(prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """P(the next `length` tokens) of a sampled row after `prompt`, for every sequence of
    positive probability."""
    law = {(): 1.0}
    for _ in range(length):
        law = {
            seq + (int(t),): p * float(q)
            for seq, p in law.items()
            for t, q in enumerate(fakes.target_distribution(prompt + list(seq)))
            if q > 0
        }
    return law


def assert_follows_the_target(outputs: list[tuple[int, ...]], prompt: list[int], length: int):
    law = target_law(prompt, length)
    cells = sorted(law)
    counts = torch.tensor([float(outputs.count(cell)) for cell in cells])
    assert counts.sum() == len(outputs), "a sequence the target never emits"
    stat, dof = chi_square(counts, torch.tensor([law[c] for c in cells]))
    assert stat < critical_0_001(dof), (stat, dof)


def test_sampled_rows_follow_the_target_in_a_mixed_batch():
    """Sampled rows at k = 1 and k = 3 drafted by the model, with greedy rows between them
    (they take no probability rows), in batches of 16 that requests join and leave: each
    group's law of all its tokens (max_tokens = k + 1: the last one is the bonus whenever
    every draft token is accepted) is the target's."""
    scheduler, _ = make_scheduler(num_slots=16, k=3, max_queue=10_000)
    prompt = [4, 4]
    groups: dict[int, list] = {1: [], 3: []}
    greedy = []
    for i in range(4_800):
        if i % 3 == 2:
            greedy.append(scheduler.submit(request(prompt, 4)))
            continue
        k = 1 if i % 3 == 0 else 3
        draft = dict(num_draft_tokens=k, fixed_num_draft_tokens=True, proposer="draft_model")
        groups[k].append(scheduler.submit(request(prompt, k + 1, temperature=1.0, seed=i, **draft)))
    run_all(scheduler, limit=100_000)
    assert all(s.token_ids[2:] == oracle_continuation(prompt, 4) for s in greedy)
    for k, sequences in groups.items():
        assert sum(s.stats.num_accepted_draft_tokens for s in sequences) > 0
        assert_follows_the_target([tuple(s.token_ids[2:]) for s in sequences], prompt, k + 1)


def test_sampled_rows_follow_the_target_with_prompt_lookup():
    """The same with prompt lookup's point-mass proposals (no draft distribution)."""
    scheduler, _ = make_scheduler(num_slots=16, k=3, max_queue=10_000)
    prompt = [4, 4, 4, 4, 4, 4]
    lookup = dict(num_draft_tokens=3, fixed_num_draft_tokens=True, proposer="ngram")
    sequences = [
        scheduler.submit(request(prompt, 3, temperature=1.0, seed=i, **lookup))
        for i in range(3_000)
    ]
    run_all(scheduler, limit=100_000)
    assert sum(s.stats.num_draft_tokens for s in sequences) > 0
    assert_follows_the_target([tuple(s.token_ids[6:]) for s in sequences], prompt, 3)


@pytest.mark.parametrize("batched", [False, True])
def test_seeded_sampling_does_not_depend_on_the_drafter(batched):
    """A seeded sampled request gets the same tokens with speculation off, at k = 1 and 3
    from the draft model, from prompt lookup, and adaptively; alone or among other rows
    (every emitted token is the target's own draw at its position)."""
    prompt = [4, 4, 4, 4, 4, 4]
    settings = {
        "off": dict(num_draft_tokens=0),
        "draft k=1": dict(num_draft_tokens=1, fixed_num_draft_tokens=True, proposer="draft_model"),
        "draft k=3": dict(num_draft_tokens=3, fixed_num_draft_tokens=True, proposer="draft_model"),
        "lookup k=3": dict(num_draft_tokens=3, fixed_num_draft_tokens=True, proposer="ngram"),
        "adaptive": {},
    }
    outputs = {}
    for name, drafting in settings.items():
        scheduler, _ = make_scheduler(num_slots=8, k=3)
        others = []
        if batched:
            others = [
                scheduler.submit(request([9, i], 30, temperature=0.7, seed=100 + i))
                for i in range(5)
            ]
        s = scheduler.submit(request(prompt, 30, temperature=1.0, seed=1234, **drafting))
        run_all(scheduler)
        outputs[name] = s.token_ids[len(prompt) :]
        if name.startswith("draft"):
            assert s.stats.num_accepted_draft_tokens > 0
        if name.startswith("lookup"):
            assert s.stats.num_draft_tokens > 0
        assert all(o.num_output_tokens == 30 for o in others)
    assert len(outputs["off"]) == 30
    assert all(tokens == outputs["off"] for tokens in outputs.values()), outputs
    scheduler, _ = make_scheduler()
    other_seed = scheduler.submit(request(prompt, 30, temperature=1.0, seed=1235))
    run_all(scheduler)
    assert other_seed.token_ids[len(prompt) :] != outputs["off"]
