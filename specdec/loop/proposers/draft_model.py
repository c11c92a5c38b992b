"""The draft model as a proposer: one `draft_model` call proposes k tokens for all its rows.

Its k for the rows that did not fix one comes from the goodput controller
(specdec/loop/controller.py), which turns speculation off where it does not pay. While it is
off, the controller still learns the draft's acceptance from probes: a greedy row's draft
catches up on the tokens plain decoding produced since its last call, and its guesses of
them in hindsight are first-position verdicts that cost no verify (`hindsight` in the wire
format, specdec/engines/wire.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from specdec.engines.wire import HINDSIGHT_TOKENS, hindsight_lengths
from specdec.loop.controller import AdaptiveController, Choice, CostCurve
from specdec.loop.proposers.base import Candidate, Proposal, Proposer, TimedStep
from specdec.loop.sequence import CacheCopy, SequenceState, engine_batch

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.calibration import Calibration
    from specdec.loop.config import SchedulerConfig


class DraftModelProposer(Proposer):
    name = "draft_model"
    calls_model = True

    def __init__(self, config: SchedulerConfig, engines: Engines, target_cost: CostCurve) -> None:
        super().__init__(config, engines, target_cost)
        self.engines = engines
        self.controller = AdaptiveController(config.max_draft_tokens, target_cost)
        self.choice = Choice(0, False, 0.0)  # the controller's choice for this step
        # Every row of this step followed the choice: only such a step is booked as what the
        # choice costs (a batch of rows that fixed k = 4 is no k = 0 iteration).
        self.whole_batch_by_choice = False
        self.called = False  # this step called the draft model

    def plan_exact(self, candidate: Candidate) -> int:
        return candidate.max_k

    def plan(
        self, candidates: list[Candidate], batch_size: int, fixed_ks: list[int]
    ) -> dict[int, int]:
        self.choice = self.controller.choose(len(candidates), fixed_ks)
        self.chosen_k = self.choice.k
        self.whole_batch_by_choice = len(candidates) == batch_size
        ks = {i: min(self.choice.k, c.max_k) for i, c in enumerate(candidates)}
        ks = {i: k for i, k in ks.items() if k > 0}
        if self.choice.probe and candidates:
            row = self._catch_up_probe(candidates)
            if row is not None:
                ks[row] = 0  # the catch-up's hindsight guesses are the probe
            elif candidates[0].max_k > 0:  # no greedy row to catch up: one row proposes one
                ks[0] = 1
        return ks

    @staticmethod
    def _catch_up_probe(candidates: list[Candidate]) -> int | None:
        """A probe that costs no verify: a greedy row's draft catches up on the output tokens
        plain decoding produced since its last call (proposing none), and its hindsight
        guesses of them are first-position verdicts; the target call stays plain decoding's.
        The row with the most such tokens (up to HINDSIGHT_TOKENS) and the least catch-up.
        None if no greedy row has any: a sampled row's tokens are draws, not the argmax."""
        best, best_key = None, None
        for i, candidate in enumerate(candidates):
            sequence = candidate.sequence
            samples = len(sequence.token_ids) - max(
                sequence.draft_cache_length + 1, len(sequence.request.prompt_ids)
            )
            if not sequence.request.greedy or samples <= 0:
                continue
            key = (min(samples, HINDSIGHT_TOKENS), -samples)
            if best_key is None or key > best_key:
                best, best_key = i, key
        return best

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        self.called = True
        batch = engine_batch(
            rows,
            pending=[s.token_ids[s.draft_cache_length :] for s in rows],
            cache_lengths=[s.draft_cache_length for s in rows],
            num_steps=ks,
            copies=copies,
        )
        start = time.perf_counter()
        result = self.engines.draft(batch)
        num_steps = int(batch.num_steps.max())
        # A catch-up or prefill would blur the cost of a step.
        if int(batch.input_lengths.max()) <= 2 and num_steps > 0:
            self.controller.observe_draft(len(rows), num_steps, time.perf_counter() - start)
        proposals = []
        guessed = hindsight_lengths(batch.input_lengths, batch.temperature)
        for row, (sequence, k) in enumerate(zip(rows, ks, strict=True)):
            self._observe_hindsight(sequence, result.hindsight(row, int(guessed[row])))
            proposals.append(Proposal(result.token_ids[row, :k].tolist()))
            # The draft cached everything it was fed: the pending tokens and k - 1 proposals.
            sequence.draft_cache_length = len(sequence.token_ids) + max(k - 1, 0)
        return proposals

    def _observe_hindsight(self, sequence: SequenceState, hits: list[bool]) -> None:
        """Scores the draft's hindsight guesses of the tokens it was just fed (the last
        len(hits) of the sequence; only a greedy row's catch-up has any, see
        wire.hindsight_lengths): whether each equals what greedy decoding produced there.
        Guesses of prompt tokens are no verdicts on output and are skipped."""
        if not hits:
            return
        first = len(sequence.token_ids) - len(hits)  # the index of the first guessed token
        skip = max(0, len(sequence.request.prompt_ids) - first)
        outputs = hits[skip:]
        self.controller.observe_hindsight(sum(outputs), len(outputs))

    def calibrated(self, calibration: Calibration) -> None:
        for rows, seconds in calibration.draft_step.items():
            self.controller.draft_step_cost.calibrate(rows, seconds)

    def observe(self, sequence: SequenceState, k: int, num_accepted: int) -> None:
        self.controller.observe_verdict(k, num_accepted)

    def observe_iteration(self, step: TimedStep, seconds: float) -> None:
        if not self.whole_batch_by_choice:
            return
        if self.choice.probe:
            self.controller.observe_probe(step.batch_size, seconds)
        else:
            self.controller.observe_iteration(step.batch_size, self.choice.k, seconds)

    def end_step(self) -> None:
        self.controller.end_iteration(drafted=self.called)
        self.called = False
