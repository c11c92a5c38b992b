"""The per-row policy: which proposer serves each row of a step, and with how many tokens.

A row whose request (or the server default) fixes k gets exactly that from its first
proposer. The other rows are offered to the proposers that cost no model call first (prompt
lookup takes the rows where its tokens pay), then to the model proposers (the draft model's
one k, which is 0 where it does not pay). How many tokens pay is the cost model's
(specdec/loop/economics.py); a row no proposer takes decodes plainly at no extra cost.
Planning runs no engine: it reads the rows, the proposers' offers and the cost model, so it
can be tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.loop.config import SchedulerConfig
from specdec.loop.economics import Economics, OtherRow, RowOffer
from specdec.loop.proposers.base import Candidate, Offer, Proposer
from specdec.loop.sequence import SequenceState


@dataclass
class StepPlan:
    """One step's proposals by batch row: who proposes, and how many tokens."""

    batch: list[SequenceState]
    ks: list[int]  # draft tokens per row (0: plain decoding)
    row_proposers: list[str | None]  # who proposes each row's tokens (None where k = 0)
    row_model: list[bool]  # the row's proposer calls a model (a catch-up at k = 0 too)
    # Proposer name -> the rows it is called for, in batch order: the rows it proposes for,
    # and those whose draft only catches up (k = 0; a model proposer's probe).
    calls: dict[str, list[int]] = field(default_factory=dict)
    chosen_k: int = 0  # a model proposer's one k for its adaptive rows

    def assign(self, row: int, proposer: Proposer, k: int) -> None:
        self.ks[row] = k
        self.row_proposers[row] = proposer.name if k > 0 else None
        self.row_model[row] = proposer.calls_model
        if k > 0 or proposer.calls_model:
            self.calls.setdefault(proposer.name, []).append(row)

    def of(self, sequence: SequenceState) -> tuple[str | None, int]:
        """The sequence's proposer and k in this step (None, 0 if it was not in the batch)."""
        for row, member in enumerate(self.batch):
            if member is sequence:
                return self.row_proposers[row], self.ks[row]
        return None, 0

    @property
    def calls_a_model(self) -> bool:
        """A model proposer is called (the draft's cache copies ride on its call)."""
        return any(self.row_model[r] for rows in self.calls.values() for r in rows)


class ProposerPolicy:
    def __init__(
        self, config: SchedulerConfig, proposers: dict[str, Proposer], economics: Economics
    ) -> None:
        self.config = config
        self.proposers = proposers
        self.economics = economics
        # Proposers without a model call plan first: a lookup that does not pay costs nothing.
        self.lookups = [p for p in proposers.values() if not p.calls_model]
        self.model_proposers = [p for p in proposers.values() if p.calls_model]

    def row_limit(self, sequence: SequenceState) -> tuple[int, bool]:
        """The row's most draft tokens per step, and whether it wants exactly that many: a
        request's num_draft_tokens caps k (exactly with fixed_num_draft_tokens); without it a
        numeric server default is exact, and "adaptive" caps at max_draft_tokens."""
        request = sequence.request
        if request.num_draft_tokens is not None:
            return request.num_draft_tokens, request.fixed_num_draft_tokens
        default = self.config.default_draft_tokens
        if default is not None:
            return default, True
        return self.config.max_draft_tokens, False

    def cap(self, sequence: SequenceState, k: int) -> int:
        """No proposals past max_tokens or past the end of the slot."""
        remaining = sequence.request.max_tokens - sequence.num_output_tokens - 1
        room = self.config.max_context - len(sequence.token_ids)
        return max(0, min(k, self.config.max_draft_tokens, remaining, room))

    def plan(self, batch: list[SequenceState]) -> StepPlan:
        num_rows = len(batch)
        plan = StepPlan(batch, [0] * num_rows, [None] * num_rows, [False] * num_rows)
        offered: dict[str, list[int]] = {name: [] for name in self.proposers}  # adaptive rows
        max_ks = []
        for row, sequence in enumerate(batch):
            limit, exact = self.row_limit(sequence)
            max_ks.append(self.cap(sequence, limit))
            names = sequence.request.proposers or self.config.proposer_names
            if limit == 0 or not names:
                continue
            if exact:
                self._assign_exact(plan, row, self.proposers[names[0]], max_ks[row])
            else:
                for name in names:
                    offered[name].append(row)
        self._plan_lookups(plan, offered, max_ks)
        for proposer in self.model_proposers:
            rows = [r for r in offered[proposer.name] if plan.row_proposers[r] is None]
            candidates = [Candidate(batch[r], max_ks[r]) for r in rows]
            for i, k in self._plan_model(plan, proposer, rows, candidates).items():
                plan.assign(rows[i], proposer, k)
        for rows in plan.calls.values():
            rows.sort()  # batch order, fixed-k rows among the others
        return plan

    def _assign_exact(self, plan: StepPlan, row: int, proposer: Proposer, max_k: int) -> None:
        """The row's request fixed k: exactly that many, or as many as the proposer has."""
        offer = proposer.offer(Candidate(plan.batch[row], max_k))
        if not proposer.calls_model:
            self.economics.lookup_planners[proposer.name].offered(plan.batch[row].id, offer.key)
        plan.assign(row, proposer, min(offer.num_tokens, max_k))

    def _plan_lookups(
        self, plan: StepPlan, offered: dict[str, list[int]], max_ks: list[int]
    ) -> None:
        """The rows the proposers without a model call take. Each row's offers are ranked
        by what its tokens are worth to it (LookupPlanner.worth: its own acceptance under
        each offer's key); every proposer plans the rows it ranks first, and a row that its
        first choice leaves without tokens goes to its next, until none is left."""
        ranked: dict[int, list[tuple[float, int, Proposer, Offer]]] = {}
        for order, proposer in enumerate(self.lookups):
            planner = self.economics.lookup_planners[proposer.name]
            for row in offered[proposer.name]:
                if plan.row_proposers[row] is not None:
                    continue
                offer = proposer.offer(Candidate(plan.batch[row], max_ks[row]))
                if offer.num_tokens > 0:
                    worth = planner.worth(plan.batch[row].id, offer.key, offer.num_tokens)
                    ranked.setdefault(row, []).append((-worth, order, proposer, offer))
        for options in ranked.values():
            options.sort(key=lambda option: option[:2])
        while ranked:
            first: dict[str, list[int]] = {}
            for row, options in ranked.items():
                first.setdefault(options[0][2].name, []).append(row)
            for name, rows in first.items():
                proposer = self.proposers[name]
                offers = []
                for i, row in enumerate(rows):
                    offer = ranked[row][0][3]
                    offers.append(RowOffer(i, offer.num_tokens, offer.key))
                planner = self.economics.lookup_planners[name]
                ks = planner.plan(offers, [plan.batch[r].id for r in rows], len(plan.batch))
                for i, row in enumerate(rows):
                    if ks.get(i, 0) > 0:
                        plan.assign(row, proposer, ks[i])
                        del ranked[row]
                    else:
                        ranked[row].pop(0)
                        if not ranked[row]:
                            del ranked[row]

    def _plan_model(
        self, plan: StepPlan, proposer: Proposer, rows: list[int], candidates: list[Candidate]
    ) -> dict[int, int]:
        """The model planner's one k for its adaptive rows, given the batch's other rows; a
        probe as the proposer makes it."""
        taken = set(rows)
        others = [
            OtherRow(plan.ks[r], plan.row_model[r])
            for r in range(len(plan.batch))
            if r not in taken
        ]
        choice = self.economics.model_planners[proposer.name].choose(len(candidates), others)
        plan.chosen_k = max(plan.chosen_k, choice.k)
        ks = {i: min(choice.k, c.max_k) for i, c in enumerate(candidates)}
        ks = {i: k for i, k in ks.items() if k > 0}
        probe = proposer.probe(candidates) if choice.probe else None
        if probe is not None:
            row, k = probe
            ks[row] = k
        return ks
