"""The start-up cost measurement (specdec/loop/calibration.py) and what it changes in the
loop's first choices, against scripted engines with a scripted clock."""

from __future__ import annotations

import pytest

import fakes
from fakes import FakeEngines, fake_decode, oracle_continuation
from specdec.loop import economics
from specdec.loop.calibration import CONTEXT_TOKENS, CalibrationPlan, calibrate
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.timing import StepTimer
from specdec.text.request import GenerationRequest


class ClockedEngines(FakeEngines):
    """FakeEngines whose calls advance a scripted clock by a cost of their shape: the target
    by tokens fed (`fixed` seconds + 1 ms per token, + `width` seconds per width of rows
    after the first, + `small_product` seconds for a call of 2 tokens or more, like float32's
    slow path for a small matrix product on 2 cores), the draft by rows and steps."""

    def __init__(
        self, num_slots: int, fixed: float = 0.010, width: float = 0.004, small_product=0.0
    ) -> None:
        super().__init__(num_slots)
        self.now = 0.0
        self.fixed = fixed
        self.width = width
        self.small_product = small_product

    def clock(self) -> float:
        return self.now

    def target_cost(self, tokens: int) -> float:
        return self.fixed + 0.001 * tokens + (self.small_product if tokens >= 2 else 0.0)

    @staticmethod
    def draft_step_cost(rows: int) -> float:
        return 0.002 + 0.0001 * rows

    def target(self, batch):
        widths = len(set(batch.input_lengths.tolist()))
        self.now += self.target_cost(len(batch.input_ids)) + self.width * (widths - 1)
        return super().target(batch)

    def draft(self, batch):
        steps = max(1, int(batch.num_steps.max()))
        self.now += self.draft_step_cost(len(batch.slot_ids)) * steps
        return super().draft(batch)


def test_the_plan_covers_the_slots_and_k():
    plan = CalibrationPlan.for_server(num_slots=64, max_k=8, budget_s=10)
    assert plan.rows == (1, 2, 4, 8, 16, 32, 64)
    assert plan.tokens_per_row == (1, 2, 9)
    assert CalibrationPlan.for_server(num_slots=6, max_k=4, budget_s=1).rows == (1, 2, 4, 6)
    assert CalibrationPlan.for_server(num_slots=512, max_k=0, budget_s=1).tokens_per_row == (1,)


def test_each_shape_is_timed_on_its_second_call_and_the_slots_hold_a_context():
    engines = ClockedEngines(num_slots=8)
    plan = CalibrationPlan.for_server(num_slots=8, max_k=4, budget_s=100)
    result = calibrate(engines, plan, with_draft=True, clock=engines.clock)
    assert set(result.target) == {(r, t) for r in (1, 2, 4, 8) for t in (1, 2, 5)}
    for (rows, tokens), seconds in result.target.items():
        assert seconds == pytest.approx(engines.target_cost(rows * tokens))
    assert set(result.draft_step) == {1, 2, 4, 8}
    for rows, seconds in result.draft_step.items():
        assert seconds == pytest.approx(engines.draft_step_cost(rows))
    # One row of 5 tokens among single ones: its tokens, and a second width.
    assert set(result.ragged) == {2, 4, 8}
    for rows, (width, seconds) in result.ragged.items():
        assert width == 5
        assert seconds == pytest.approx(engines.target_cost(rows + 4) + engines.width)
    assert result.width_costs() == pytest.approx({2: 0.004, 4: 0.004, 8: 0.004})
    assert "a second width in a verify ms by rows [2: 4.0, 4: 4.0, 8: 4.0]" in result.summary()
    assert result.skipped == 0
    # Every timed call ran after the context: each slot was given CONTEXT_TOKENS positions
    # once (FakeEngines refuses a cache length beyond what a slot holds).
    fed = [lengths for role, lengths in engines.input_lengths if role == "target"]
    contexts = [lengths for lengths in fed if set(lengths) == {CONTEXT_TOKENS}]
    assert sum(len(lengths) for lengths in contexts) == 8
    assert result.seconds == pytest.approx(engines.now)
    assert "target call ms by rows x tokens per row" in result.summary()


def test_the_budget_keeps_the_small_batches_and_says_what_it_skipped():
    engines = ClockedEngines(num_slots=64)
    plan = CalibrationPlan.for_server(num_slots=64, max_k=8, budget_s=0.5)
    result = calibrate(engines, plan, with_draft=True, clock=engines.clock)
    assert (1, 1) in result.target and 1 in result.draft_step
    assert (64, 9) not in result.target and 64 not in result.draft_step
    measured_rows = {r for r, _ in result.target} | set(result.draft_step)
    assert max(measured_rows) < 64
    # Batch sizes in order, each with its draft first: only the largest measured size may
    # be partly measured, and the slots beyond it were never filled.
    for rows in measured_rows - {max(measured_rows)}:
        assert {(rows, t) for t in plan.tokens_per_row} <= set(result.target)
    assert all(len(engines.target_cache[s]) == 0 for s in range(max(measured_rows), 64))
    total = len(plan.rows) * (len(plan.tokens_per_row) + 2) - 1  # no ragged verify of 1 row
    measured = len(result.target) + len(result.draft_step) + len(result.ragged)
    assert result.skipped == total - measured > 0
    assert "skipped" in result.summary()


def test_without_a_draft_model_the_draft_is_never_called():
    engines = ClockedEngines(num_slots=4)
    plan = CalibrationPlan.for_server(num_slots=4, max_k=4, budget_s=100)
    result = calibrate(engines, plan, with_draft=False, clock=engines.clock)
    assert not result.draft_step and not any(role == "draft" for role, _ in engines.calls)


def adaptive_config(num_slots: int = 16) -> SchedulerConfig:
    return SchedulerConfig(
        num_slots=num_slots, max_context=256, max_draft_tokens=4, default_draft_tokens=None
    )


def requests(n: int, max_tokens: int = 12) -> list[GenerationRequest]:
    return [GenerationRequest(None, [3 + i, 7, 11 + i, 5], max_tokens) for i in range(n)]


def test_the_scheduler_gives_the_measurements_to_the_curves_and_still_decodes_exactly():
    engines = ClockedEngines(num_slots=16)
    scheduler = SpeculativeScheduler(engines, adaptive_config(), fake_decode)
    calibration = scheduler.calibrate(budget_s=100, clock=engines.clock)
    costs = scheduler.economics.costs
    assert costs.target.estimate(16) == pytest.approx(calibration.target[(16, 1)], rel=0.25)
    assert costs.draft_step.estimate(16) == pytest.approx(calibration.draft_step[16])
    # A second width of rows in a verify is priced at what start-up measured.
    assert costs.width.estimate(16) == pytest.approx(engines.width)
    # What calibration left in the slots changes nothing: every sequence decodes the oracle's.
    sequences = [scheduler.submit(r) for r in requests(16)]
    while scheduler.has_work:
        scheduler.step()
    for sequence in sequences:
        prompt = sequence.request.prompt_ids
        assert sequence.token_ids[len(prompt) :] == oracle_continuation(prompt, 12)
    scheduler.submit(requests(1)[0])
    scheduler.step()
    with pytest.raises(RuntimeError, match="before the first request runs"):
        scheduler.calibrate(budget_s=1)


def draft_rows_in_first_steps(calibrated: bool, steps: int = 12) -> list[int]:
    engines = ClockedEngines(num_slots=16)
    scheduler = SpeculativeScheduler(engines, adaptive_config(), fake_decode)
    if calibrated:
        scheduler.calibrate(budget_s=100, clock=engines.clock)
    engines.calls.clear()
    for request in requests(16, max_tokens=40):
        scheduler.submit(request)
    for _ in range(steps):
        scheduler.step()
    return [rows for role, rows in engines.calls if role == "draft"]


def test_a_calibrated_server_does_not_bet_the_first_burst_on_an_unmeasured_draft():
    """Uncalibrated, the draft's k is tried at 1 on all 16 rows of a fresh burst to learn what
    a draft step costs (16 draft catch-ups of whole prompts); calibrated, it knows, and its
    first draft calls are probes of one row each."""
    assert 16 in draft_rows_in_first_steps(calibrated=False)
    assert all(rows == 1 for rows in draft_rows_in_first_steps(calibrated=True))


def first_step_lookup_rows(rows: int) -> int:
    """Rows that prompt lookup proposes for in a fresh, calibrated server's first step, with
    `rows` requests whose prompts repeat (every row has a match). The target's fixed cost
    is 37.3 ms, so one token more per row costs 1.3x at 16 rows and 1.03x at one row."""
    engines = ClockedEngines(num_slots=16, fixed=0.0373)
    config = adaptive_config()
    config.proposer_names = ("ngram",)
    scheduler = SpeculativeScheduler(engines, config, fake_decode)
    scheduler.calibrate(budget_s=100, clock=engines.clock)
    for i in range(rows):
        scheduler.submit(GenerationRequest(None, [5 + i, 6, 7, 5 + i, 6, 7, 5 + i, 6], 20))
    plan = scheduler.step().plan
    assert plan is not None
    return sum(k > 0 for k in plan.ks)


def test_a_fresh_servers_lookups_bet_only_where_a_token_costs_little(monkeypatch):
    """Before any lookup is verified, prompt lookup assumes COLD_PRIOR (0.25) acceptance:
    one row's lookups go ahead (a verify of two tokens costs 1.03 steps), sixteen rows' do
    not (1.3 steps): only one row probes, to learn what a lookup of its match length is
    worth. With the old prior of one half every row's went ahead."""
    assert first_step_lookup_rows(rows=1) == 1
    assert first_step_lookup_rows(rows=16) == 1
    monkeypatch.setattr(economics, "COLD_PRIOR", 0.5)
    assert first_step_lookup_rows(rows=16) == 16


def iterations_with_lookups(monkeypatch, steps: int, rows: int, small_product=0.0) -> int:
    """Steps in which prompt lookup proposed, over `steps` steps of `rows` requests that join
    one per step and whose lookups are never accepted (the scripted target does not repeat
    the prompt); the loop times its steps by the scripted clock."""
    engines = ClockedEngines(num_slots=16, fixed=0.0373, small_product=small_product)
    config = adaptive_config()
    config.proposer_names = ("ngram",)
    scheduler = SpeculativeScheduler(engines, config, fake_decode)
    scheduler.engines.clock = engines.clock
    timer = StepTimer(scheduler, clock=engines.clock)
    scheduler.calibrate(budget_s=100, clock=engines.clock)
    proposing = 0
    for step in range(steps):
        if step < rows:
            prompt = [5 + step, 6, 7, 5 + step, 6, 7, 5 + step, 6]
            scheduler.submit(GenerationRequest(None, prompt, 200))
        stats = timer.step().stats
        if stats is None:  # every request finished
            break
        proposing += stats.num_draft_tokens > 0
    return proposing


def test_lookup_probes_come_about_once_per_sixteen_steps_whatever_the_batch(monkeypatch):
    """A row whose lookups are not used probes its lookup after PROBE_EVERY x batch steps: a
    batch of 16 rows that joined at different steps probes about as often as one row, not 16
    times as often (each probe makes the verify's rows unequal in length, which costs about
    a step's worth). With PROBE_EVERY steps whatever the batch, some row probed in most
    steps."""
    assert iterations_with_lookups(monkeypatch, 96, rows=1) <= 96 // economics.PROBE_EVERY
    assert iterations_with_lookups(monkeypatch, 96, rows=16) <= 96 // economics.PROBE_EVERY


def test_lookup_probes_space_out_where_one_more_token_costs_a_lot(monkeypatch):
    """float32 on 2 cores, 1 row: a verify of two tokens cost 86 ms against a plain step's
    50, so a probe every 16 steps cost 4% of the time. Probes then come as rarely as keeps
    them within PROBE_BUDGET of plain decoding's time, as start-up measured it:
    here a lookup of 4 tokens costs 39 ms more than a plain step of 38, one probe in about
    100 steps (and the first, which no lookup of its match length had preceded)."""
    steps = 192  # a request's 200 tokens
    assert iterations_with_lookups(monkeypatch, steps, rows=1, small_product=0.035) <= 3
    monkeypatch.setattr(economics, "PROBE_BUDGET", float("inf"))  # every PROBE_EVERY steps
    assert iterations_with_lookups(monkeypatch, steps, rows=1, small_product=0.035) >= 8


def lookup_share_of_one_copying_row(monkeypatch, small_product: float) -> float:
    """The share of a 200-token answer that came from accepted lookups, one row on a fresh,
    calibrated server whose target copies the prompt."""
    monkeypatch.setattr(fakes, "oracle_next", fakes.copying_oracle)
    engines = ClockedEngines(num_slots=4, fixed=0.0373, small_product=small_product)
    config = SchedulerConfig(4, 256, max_draft_tokens=8, default_draft_tokens=None)
    config.proposer_names = ("ngram",)
    scheduler = SpeculativeScheduler(engines, config, fake_decode)
    scheduler.engines.clock = engines.clock
    timer = StepTimer(scheduler, clock=engines.clock)
    scheduler.calibrate(budget_s=100, clock=engines.clock)
    sequence = scheduler.submit(GenerationRequest(None, [11, 12, 13, 14, 15, 16, 17], 200, -1))
    while scheduler.has_work:
        timer.step()
    return sequence.stats.num_accepted_draft_tokens / sequence.num_output_tokens


@pytest.mark.parametrize("small_product", [0.0, 0.035])
def test_a_copying_row_learns_its_lookups_pay_even_where_a_short_verify_is_dear(
    monkeypatch, small_product
):
    """float32 on 2 cores, 1 row: a verify of 2 tokens costs about 1.6 plain steps, and one of
    9 not much more. A probe of one token teaches only the first position, and at that price
    the plan never tries more: the cold rewrite burst read 1.03x of k = 0 where it had read
    1.39x. A probe proposes what the row's lookup holds, so the later positions are learnt too
    and a copying answer comes mostly from lookups, whatever a short verify costs."""
    assert lookup_share_of_one_copying_row(monkeypatch, small_product) > 0.6
