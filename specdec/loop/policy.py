"""The per-row policy: which proposer serves each row of a step, and with how many tokens.

A row whose request (or the server default) fixes k gets exactly that from its first
proposer. The other rows are offered to the proposers that cost no model call first (prompt
lookup takes the rows where its plan pays), then to the model proposers (the draft model's
goodput controller, which turns speculation off where it does not pay). A row no proposer
takes decodes plainly at no extra cost. Planning runs no engine: it only reads the rows and
the proposers' measurements, so it can be tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.loop.config import SchedulerConfig
from specdec.loop.proposers.base import Candidate, Proposer
from specdec.loop.sequence import SequenceState


@dataclass
class StepPlan:
    """One step's plan, by batch row."""

    batch: list[SequenceState]
    ks: list[int]  # draft tokens per row (0: plain decoding)
    proposers: list[str | None]  # who proposes each row's tokens (None where k = 0)
    # Proposer name -> the rows it is called for, in batch order: the rows it proposes for,
    # and those whose draft only catches up (k = 0; a model proposer's probe).
    calls: dict[str, list[int]] = field(default_factory=dict)
    chosen_k: int = 0  # the model proposer's one k for its adaptive rows

    def assign(self, row: int, proposer: Proposer, k: int) -> None:
        self.ks[row] = k
        self.proposers[row] = proposer.name if k > 0 else None
        if k > 0 or proposer.calls_model:
            self.calls.setdefault(proposer.name, []).append(row)

    def of(self, sequence: SequenceState) -> tuple[str | None, int]:
        """The sequence's proposer and k in this step (None, 0 if it was not in the batch)."""
        for row, member in enumerate(self.batch):
            if member is sequence:
                return self.proposers[row], self.ks[row]
        return None, 0


class ProposerPolicy:
    def __init__(self, config: SchedulerConfig, proposers: dict[str, Proposer]) -> None:
        self.config = config
        self.proposers = proposers
        # Proposers without a model call plan first: a lookup that does not pay costs nothing.
        self.planning_order = sorted(proposers.values(), key=lambda p: p.calls_model)

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
        plan = StepPlan(batch, ks=[0] * len(batch), proposers=[None] * len(batch))
        offered: dict[str, list[int]] = {name: [] for name in self.proposers}  # adaptive rows
        fixed_ks: list[int] = []  # rows outside the model proposers' choice
        max_ks = []
        for row, sequence in enumerate(batch):
            limit, exact = self.row_limit(sequence)
            max_ks.append(self.cap(sequence, limit))
            request_proposer = sequence.request.proposer
            names = (request_proposer,) if request_proposer else self.config.proposers
            if limit == 0 or not names:
                fixed_ks.append(0)
            elif exact:
                proposer = self.proposers[names[0]]
                plan.assign(row, proposer, proposer.plan_exact(Candidate(sequence, max_ks[row])))
                if proposer.calls_model:
                    fixed_ks.append(plan.ks[row])
            else:
                for name in names:
                    offered[name].append(row)
        for proposer in self.planning_order:
            rows = [r for r in offered[proposer.name] if plan.proposers[r] is None]
            candidates = [Candidate(batch[r], max_ks[r]) for r in rows]
            for i, k in proposer.plan(candidates, len(batch), fixed_ks).items():
                plan.assign(rows[i], proposer, k)
        for rows in plan.calls.values():
            rows.sort()  # batch order, fixed-k rows among the others
        plan.chosen_k = max((p.chosen_k for p in self.proposers.values()), default=0)
        return plan

    def calls_a_model(self, plan: StepPlan) -> bool:
        """A model proposer is called this step (the draft's cache copies ride on its call)."""
        return any(self.proposers[name].calls_model for name in plan.calls)
