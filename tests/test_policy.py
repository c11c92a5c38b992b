"""The per-row policy (specdec/loop/policy.py) without engines, and the proposer interface
(specdec/loop/proposers/) as a new proposer would use it."""

from __future__ import annotations

import pytest

from fakes import FakeEngines, fake_decode, oracle_continuation
from specdec.loop.config import SchedulerConfig
from specdec.loop.economics import Choice, OtherRow
from specdec.loop.policy import ProposerPolicy
from specdec.loop.proposers import REGISTRY
from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState
from specdec.text.request import GenerationRequest


class ScriptedProposer(Proposer):
    """Offers `k` tokens to every row (0 to those whose first prompt token is in `none`)."""

    verdicts_per_probe = 1

    def __init__(self, name: str, k: int, calls_model: bool = False, none=()) -> None:
        self.name = name  # type: ignore[misc]  # an instance's name: several in one test
        self.calls_model = calls_model  # type: ignore[misc]
        self.k, self.none = k, set(none)

    def offer(self, candidate: Candidate) -> Offer:
        if candidate.sequence.token_ids[0] in self.none:
            return Offer(0)
        return Offer(min(self.k, candidate.max_k), key=candidate.sequence.token_ids[0])

    def propose(self, rows, ks, copies):
        return [Proposal([0] * k) for k in ks]


class ScriptedPlanners:
    """The cost model's planners, scripted: a lookup planner takes the offers of rows whose
    first token is in `takes`; a model planner chooses `k`. Each records what it was asked."""

    def __init__(self, takes=(), k=0, probe=False) -> None:
        self.takes, self.k, self.probe = set(takes), k, probe
        self.asked: list = []
        self.rows: dict[int, int | None] = {}

    def offered(self, sequence_id, key):
        self.rows[sequence_id] = key

    def worth(self, sequence_id, key, num_tokens):
        return float(num_tokens)

    def plan(self, offers, sequence_ids, batch_size):
        self.asked.append(([(o.row, o.max_tokens, o.key) for o in offers], batch_size))
        return {o.row: o.max_tokens for o in offers if o.key in self.takes}

    def choose(self, num_adaptive, others):
        self.asked.append((num_adaptive, others))
        return Choice(self.k, self.probe)


class ScriptedEconomics:
    def __init__(self, lookup: ScriptedPlanners, model: ScriptedPlanners) -> None:
        self.lookup_planners = {"ngram": lookup}
        self.model_planners = {"draft_model": model}


def config(**kw) -> SchedulerConfig:
    kw.setdefault("default_draft_tokens", None)
    kw.setdefault("proposer_names", ("draft_model", "ngram"))
    return SchedulerConfig(num_slots=8, max_context=64, max_draft_tokens=6, **kw)


def row(first_token: int, max_tokens: int = 50, **kw) -> SequenceState:
    request = GenerationRequest(None, [first_token, 1, 2], max_tokens, **kw)
    return SequenceState(request, detokenizer=None, seed=0, token_ids=list(request.prompt_ids))  # type: ignore[arg-type]


def scripted_policy(server: SchedulerConfig, takes=(), k=0, probe=False):
    lookup, model = ScriptedPlanners(takes=takes), ScriptedPlanners(k=k, probe=probe)
    proposers = {
        "draft_model": ScriptedProposer("draft_model", k=server.max_draft_tokens, calls_model=True),
        "ngram": ScriptedProposer("ngram", k=2, none={5}),
    }
    economics = ScriptedEconomics(lookup, model)
    return ProposerPolicy(server, proposers, economics), lookup, model  # type: ignore[arg-type]


def test_lookups_plan_first_and_the_model_gets_only_the_rows_they_left():
    policy, lookup, model = scripted_policy(config(), takes={1, 3}, k=4)
    batch = [row(1), row(2), row(3), row(4, num_draft_tokens=0), row(5)]
    plan = policy.plan(batch)
    assert plan.row_proposers == ["ngram", "draft_model", "ngram", None, "draft_model"]
    assert plan.ks == [2, 4, 2, 0, 4]
    assert plan.calls == {"ngram": [0, 2], "draft_model": [1, 4]}
    # Row 4 asked for no speculation; row 5 has no lookup: neither is offered to the planner.
    assert lookup.asked == [([(0, 2, 1), (1, 2, 2), (2, 2, 3)], 5)]
    # The model's choice sees the batch's other rows: two lookups and a plain row.
    others = [OtherRow(2, model=False), OtherRow(2, model=False), OtherRow(0, model=False)]
    assert model.asked == [(2, others)]
    assert plan.chosen_k == 4
    assert plan.calls_a_model


class WorthPlanner(ScriptedPlanners):
    """A lookup planner whose offers are worth `worth[first token]` (default 1)."""

    def __init__(self, takes=(), worth=None) -> None:
        super().__init__(takes=takes)
        self.worth_by_token = worth or {}

    def worth(self, sequence_id, key, num_tokens):
        return self.worth_by_token.get(key, 1.0)


def test_each_row_goes_to_the_lookup_its_tokens_are_worth_most_to_then_to_the_next():
    """Rows 1 and 2: the suffix lookup is worth more, and takes them both; row 3: prompt
    lookup is worth more but leaves it without tokens, so it is offered to suffix next, which
    takes it; row 4: neither lookup takes it, and the draft model gets it."""
    ngram, suffix = WorthPlanner(takes={3}, worth={3: 5.0}), WorthPlanner(takes={1, 2, 3})
    suffix.worth_by_token = {1: 2.0, 2: 2.0, 3: 0.5, 4: 2.0}
    model = ScriptedPlanners(k=4)
    economics = ScriptedEconomics(ngram, model)
    economics.lookup_planners["suffix"] = suffix
    proposers = {
        "draft_model": ScriptedProposer("draft_model", k=6, calls_model=True),
        "ngram": ScriptedProposer("ngram", k=2),
        "suffix": ScriptedProposer("suffix", k=3),
    }
    server = config(proposer_names=("draft_model", "ngram", "suffix"))
    policy = ProposerPolicy(server, proposers, economics)  # type: ignore[arg-type]
    ngram.takes = set()  # prompt lookup leaves row 3 without tokens
    plan = policy.plan([row(1), row(2), row(3), row(4)])
    assert plan.row_proposers == ["suffix", "suffix", "suffix", "draft_model"]
    assert plan.ks == [3, 3, 3, 4]
    # Asked in rounds: each for the rows it ranks first (suffix: 1, 2, 4; prompt lookup: 3),
    # then each for the rows the other left (suffix: 3; prompt lookup: 4, which it leaves).
    assert ngram.asked == [([(0, 2, 3)], 4), ([(0, 2, 4)], 4)]
    assert suffix.asked == [([(0, 3, 1), (1, 3, 2), (2, 3, 4)], 4), ([(0, 3, 3)], 4)]


def test_a_fixed_k_goes_to_the_first_proposer_and_is_capped_by_max_tokens_and_context():
    policy, lookup, model = scripted_policy(config())
    fixed = {"num_draft_tokens": 5, "fixed_num_draft_tokens": True}
    batch = [
        row(1, **fixed),  # the server's first proposer: the draft model
        row(2, **fixed, proposers=("ngram",)),  # a lookup has at most its offer: 2
        row(3, max_tokens=3, **fixed),  # 2 more tokens after this one's: k <= 2 - 0
        row(4, num_draft_tokens=9),  # a cap above the server's: max_draft_tokens
    ]
    plan = policy.plan(batch)
    assert plan.ks[:3] == [5, 2, 2]
    assert plan.row_proposers[:3] == ["draft_model", "ngram", "draft_model"]
    assert lookup.rows == {batch[1].id: 2}  # the fixed row's verdict counts under its key
    # The model's fixed rows reach its choice as other rows that it drafts.
    assert model.asked == [(1, [OtherRow(5, True), OtherRow(2, False), OtherRow(2, True)])]
    assert plan.ks[3] == 0  # neither took it: plain decoding
    long = row(5, max_tokens=1000)
    long.token_ids += [7] * 60  # one position left in the slot
    assert policy.cap(long, 6) == 1
    long.token_ids.append(7)  # the slot is full: no room to propose
    assert policy.cap(long, 6) == 0


def test_a_server_default_k_is_exact_and_zero_turns_speculation_off():
    server = config(default_draft_tokens=3, proposer_names=("draft_model",))
    policy, _, model = scripted_policy(server)
    plan = policy.plan([row(1), row(2, num_draft_tokens=0)])
    assert plan.ks == [3, 0] and plan.row_proposers == ["draft_model", None]
    assert model.asked == [(0, [OtherRow(3, True), OtherRow(0, False)])]


def test_the_draft_models_probe_catches_up_one_greedy_row_without_proposing(monkeypatch):
    server = config(proposer_names=("draft_model",))
    scheduler = SpeculativeScheduler(FakeEngines(8), server, fake_decode)
    planner = scheduler.economics.model_planners["draft_model"]
    monkeypatch.setattr(planner, "choose", lambda n, others: Choice(0, probe=True))
    behind, sampled, fresh = row(1), row(2, temperature=0.7), row(3)
    for sequence in (behind, sampled):  # 10 output tokens the draft has not seen
        sequence.token_ids += list(range(10))
    plan = scheduler.policy.plan([fresh, sampled, behind])
    assert plan.ks == [0, 0, 0] and plan.row_proposers == [None, None, None]
    assert plan.calls == {"draft_model": [2]}  # called for the greedy row that fell behind
    assert plan.calls_a_model


def test_the_scheduler_runs_a_new_proposer_from_its_registration(monkeypatch):
    """A proposer that guesses the previous token again: one class and one registry line,
    no economics of its own. The cost model probes its offers (no verdict has reached
    them yet) and learns what they are worth; the fakes' target rarely repeats a token, so
    most guesses are rejected. Output stays the target's greedy text, and the proposer sees
    every row's end."""

    class RepeatProposer(Proposer):
        name = "repeat"
        calls_model = False
        verdicts_per_probe = 1

        def __init__(self, config, engines) -> None:
            super().__init__(config, engines)
            self.offered: set[int] = set()
            self.live: set[int] = set()
            self.released: list[int] = []

        def offer(self, candidate):
            self.offered.add(candidate.sequence.id)
            return Offer(min(2, candidate.max_k))

        def propose(self, rows, ks, copies):
            self.live |= {s.id for s in rows}
            return [Proposal([s.token_ids[-1]] * k) for s, k in zip(rows, ks, strict=True)]

        def release(self, sequence):
            self.released.append(sequence.id)

    monkeypatch.setitem(REGISTRY, "repeat", RepeatProposer)
    server = config(proposer_names=("repeat",))
    scheduler = SpeculativeScheduler(FakeEngines(8), server, fake_decode)
    prompts = [[i + 1, 2 * i + 3] for i in range(5)]
    sequences = [scheduler.submit(GenerationRequest(None, p, 20, end_id=-1)) for p in prompts]
    while scheduler.has_work:
        scheduler.step()
    for prompt, sequence in zip(prompts, sequences, strict=True):
        assert sequence.token_ids[2:] == oracle_continuation(prompt, 20)
    proposer = scheduler.proposers["repeat"]
    assert isinstance(proposer, RepeatProposer)
    window = scheduler.economics.lookup_planners["repeat"].window(None)
    assert window.explored and window.accepted[0] < window.tried[0]  # mostly rejected
    assert proposer.live and proposer.live <= proposer.offered
    assert sorted(proposer.released) == sorted(s.id for s in sequences)


@pytest.mark.parametrize("end", ["finish", "cancel", "fail"])
def test_prompt_lookup_drops_a_rows_state_when_it_ends(end):
    scheduler = SpeculativeScheduler(FakeEngines(8), config(), fake_decode)
    sequence = scheduler.submit(GenerationRequest(None, [5, 6, 5, 6], 30, end_id=-1))
    scheduler.step()
    lookup = scheduler.proposers["ngram"]
    planner = scheduler.economics.lookup_planners["ngram"]
    assert sequence.id in lookup.indexes and sequence.id in planner.rows  # type: ignore[attr-defined]
    if end == "cancel":
        scheduler.cancel(sequence)
        scheduler.step()
    elif end == "fail":
        scheduler.fail_all()
    while scheduler.has_work:
        scheduler.step()
    assert lookup.indexes == lookup.lookups == planner.rows == {}  # type: ignore[attr-defined]
