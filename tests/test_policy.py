"""The per-row policy (specdec/loop/policy.py) without engines, and the proposer interface
(specdec/loop/proposers/) as a new proposer would use it."""

from __future__ import annotations

import pytest

from fakes import FakeEngines, fake_decode, oracle_continuation
from specdec.loop.config import SchedulerConfig
from specdec.loop.controller import Choice, CostCurve
from specdec.loop.policy import ProposerPolicy
from specdec.loop.proposers import REGISTRY
from specdec.loop.proposers.base import Candidate, Proposal, Proposer
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState
from specdec.text.request import GenerationRequest


class ScriptedProposer(Proposer):
    """Takes the rows whose first prompt token is in `takes`, at k = `k`; records its offers."""

    calls_model = False

    def __init__(self, name: str, takes: set[int], k: int, calls_model: bool = False) -> None:
        self.name = name  # type: ignore[misc]  # an instance's name: several in one test
        self.calls_model = calls_model  # type: ignore[misc]
        self.takes, self.k = takes, k
        self.chosen_k = 0
        self.offers: list[tuple[list[int], int, list[int]]] = []  # (first tokens, size, fixed)

    def plan_exact(self, candidate: Candidate) -> int:
        return candidate.max_k

    def plan(self, candidates, batch_size, fixed_ks):
        self.offers.append(([c.sequence.token_ids[0] for c in candidates], batch_size, fixed_ks))
        return {
            i: min(self.k, c.max_k)
            for i, c in enumerate(candidates)
            if c.sequence.token_ids[0] in self.takes
        }

    def propose(self, rows, ks, copies):
        return [Proposal([0] * k) for k in ks]

    def observe(self, sequence, k, num_accepted):
        pass


def config(**kw) -> SchedulerConfig:
    kw.setdefault("default_draft_tokens", None)
    return SchedulerConfig(num_slots=8, max_context=64, max_draft_tokens=6, **kw)


def row(first_token: int, max_tokens: int = 50, **kw) -> SequenceState:
    request = GenerationRequest(None, [first_token, 1, 2], max_tokens, **kw)
    return SequenceState(request, detokenizer=None, seed=0, token_ids=list(request.prompt_ids))  # type: ignore[arg-type]


def test_lookups_plan_first_and_the_model_gets_only_the_rows_they_left():
    lookup = ScriptedProposer("ngram", takes={1, 3}, k=2)
    model = ScriptedProposer("draft_model", takes={2, 3, 4}, k=4, calls_model=True)
    policy = ProposerPolicy(config(), {"draft_model": model, "ngram": lookup})
    batch = [row(1), row(2), row(3), row(4, num_draft_tokens=0)]
    plan = policy.plan(batch)
    assert plan.proposers == ["ngram", "draft_model", "ngram", None]
    assert plan.ks == [2, 4, 2, 0]
    assert plan.calls == {"ngram": [0, 2], "draft_model": [1]}
    assert lookup.offers == [([1, 2, 3], 4, [0])]
    assert model.offers == [([2], 4, [0])]  # row 4 asked for no speculation: a fixed k of 0
    assert policy.calls_a_model(plan)


def test_a_fixed_k_goes_to_the_first_proposer_and_is_capped_by_max_tokens_and_context():
    lookup = ScriptedProposer("ngram", takes=set(), k=2)
    model = ScriptedProposer("draft_model", takes=set(), k=4, calls_model=True)
    policy = ProposerPolicy(config(), {"draft_model": model, "ngram": lookup})
    fixed = {"num_draft_tokens": 5, "fixed_num_draft_tokens": True}
    batch = [
        row(1, **fixed),  # the server's first proposer: the draft model
        row(2, **fixed, proposer="ngram"),
        row(3, max_tokens=3, **fixed),  # 2 more tokens after this one's: k <= 2 - 0
        row(4, num_draft_tokens=9),  # a cap above the server's: max_draft_tokens
    ]
    plan = policy.plan(batch)
    assert plan.ks[:3] == [5, 5, 2]
    assert plan.proposers[:3] == ["draft_model", "ngram", "draft_model"]
    # The model's fixed rows reach its choice as fixed k; the lookup's fixed row does not.
    assert model.offers == [([4], 4, [5, 2])]
    assert lookup.offers == [([4], 4, [5, 2])]
    assert plan.ks[3] == 0  # neither took it: plain decoding
    long = row(5, max_tokens=1000)
    long.token_ids += [7] * 60  # one position left in the slot
    assert policy.cap(long, 6) == 1
    long.token_ids.append(7)  # the slot is full: no room to propose
    assert policy.cap(long, 6) == 0


def test_a_server_default_k_is_exact_and_zero_turns_speculation_off():
    model = ScriptedProposer("draft_model", takes={1}, k=4, calls_model=True)
    server = config(default_draft_tokens=3, proposers=("draft_model",))
    policy = ProposerPolicy(server, {"draft_model": model})
    plan = policy.plan([row(1), row(2, num_draft_tokens=0)])
    assert plan.ks == [3, 0] and plan.proposers == ["draft_model", None]


def test_the_draft_models_probe_catches_up_one_greedy_row_without_proposing(monkeypatch):
    model = REGISTRY["draft_model"](config(), FakeEngines(8), CostCurve())
    policy = ProposerPolicy(config(proposers=("draft_model",)), {"draft_model": model})
    monkeypatch.setattr(model.controller, "choose", lambda n, fixed: Choice(0, True, 0.0))
    behind, sampled, fresh = row(1), row(2, temperature=0.7), row(3)
    for sequence in (behind, sampled):  # 10 output tokens the draft has not seen
        sequence.token_ids += list(range(10))
    plan = policy.plan([fresh, sampled, behind])
    assert plan.ks == [0, 0, 0] and plan.proposers == [None, None, None]
    assert plan.calls == {"draft_model": [2]}  # called for the greedy row that fell behind
    assert policy.calls_a_model(plan)


def test_the_scheduler_runs_a_new_proposer_from_its_registration(monkeypatch):
    """A proposer that guesses the previous token again: one class and one registry line.
    The fakes' target rarely repeats a token, so most guesses are rejected; output stays
    the target's greedy text, and the proposer sees every verdict and every row's end."""

    class RepeatProposer(Proposer):
        name = "repeat"
        calls_model = False

        def __init__(self, config, engines, target_cost) -> None:
            super().__init__(config, engines, target_cost)
            self.verdicts: list[tuple[int, int]] = []
            self.live: set[int] = set()
            self.released: list[int] = []

        def plan_exact(self, candidate):
            return candidate.max_k

        def plan(self, candidates, batch_size, fixed_ks):
            return {i: min(2, c.max_k) for i, c in enumerate(candidates)}

        def propose(self, rows, ks, copies):
            self.live |= {s.id for s in rows}
            return [Proposal([s.token_ids[-1]] * k) for s, k in zip(rows, ks, strict=True)]

        def observe(self, sequence, k, num_accepted):
            self.verdicts.append((k, num_accepted))

        def release(self, sequence):
            self.released.append(sequence.id)

    monkeypatch.setitem(REGISTRY, "repeat", RepeatProposer)
    scheduler = SpeculativeScheduler(FakeEngines(8), config(proposers=("repeat",)), fake_decode)
    prompts = [[i + 1, 2 * i + 3] for i in range(5)]
    sequences = [scheduler.submit(GenerationRequest(None, p, 20, end_id=-1)) for p in prompts]
    while scheduler.has_work:
        scheduler.step()
    for prompt, sequence in zip(prompts, sequences, strict=True):
        assert sequence.token_ids[2:] == oracle_continuation(prompt, 20)
    proposer = scheduler.proposers["repeat"]
    assert isinstance(proposer, RepeatProposer)
    assert proposer.verdicts and all(k == 2 for k, _ in proposer.verdicts[:5])
    assert sorted(proposer.released) == sorted(s.id for s in sequences) == sorted(proposer.live)


@pytest.mark.parametrize("end", ["finish", "cancel", "fail"])
def test_prompt_lookup_drops_a_rows_state_when_it_ends(end):
    scheduler = SpeculativeScheduler(FakeEngines(8), config(), fake_decode)
    sequence = scheduler.submit(GenerationRequest(None, [5, 6, 5, 6], 30, end_id=-1))
    scheduler.step()
    lookup = scheduler.proposers["ngram"]
    assert sequence.id in lookup.rows  # type: ignore[attr-defined]
    if end == "cancel":
        scheduler.cancel(sequence)
        scheduler.step()
    elif end == "fail":
        scheduler.fail_all()
    while scheduler.has_work:
        scheduler.step()
    assert lookup.rows == {}  # type: ignore[attr-defined]
