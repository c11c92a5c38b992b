"""The draft model as a proposer: one `draft_model` call proposes k tokens for all its rows.

Its rows' k is the cost model's (specdec/loop/economics.py, ModelPlanner), which turns
speculation off where it does not pay. While it is off, the cost model still learns the
draft's acceptance from probes: a greedy row's draft catches up on the tokens plain decoding
produced since its last call, and its guesses of them in hindsight are first-position
verdicts that cost no verify (`hindsight` in the wire format, specdec/engines/wire.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.engines.wire import HINDSIGHT_TOKENS, hindsight_lengths
from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.sequence import CacheCopy, SequenceState, engine_batch

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig


class DraftModelProposer(Proposer):
    name = "draft_model"
    calls_model = True
    verdicts_per_probe = HINDSIGHT_TOKENS  # a catch-up guesses up to this many tokens

    def __init__(self, config: SchedulerConfig, engines: Engines) -> None:
        super().__init__(config, engines)
        self.engines = engines

    def offer(self, candidate: Candidate) -> Offer:
        return Offer(candidate.max_k)

    def probe(self, candidates: list[Candidate]) -> tuple[int, int] | None:
        """A probe that costs no verify: a greedy row's draft catches up on the output tokens
        plain decoding produced since its last call (proposing none), and its hindsight
        guesses of them are first-position verdicts; the target call stays plain decoding's.
        The row with the most such tokens (up to HINDSIGHT_TOKENS) and the least catch-up.
        Without one (a sampled row's tokens are draws, not the argmax), one row proposes one
        token."""
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
        if best is not None:
            return best, 0
        if candidates and candidates[0].max_k > 0:
            return 0, 1
        return None

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        batch = engine_batch(
            rows,
            pending=[s.token_ids[s.draft_cache_length :] for s in rows],
            cache_lengths=[s.draft_cache_length for s in rows],
            num_steps=ks,
            copies=copies,
        )
        result = self.engines.draft(batch)
        guessed = hindsight_lengths(batch.input_lengths, batch.temperature)
        proposals = []
        for row, (sequence, k) in enumerate(zip(rows, ks, strict=True)):
            hits = output_hindsight(sequence, result.hindsight(row, int(guessed[row])))
            tokens = result.token_ids[row, :k].tolist()
            if -1 in tokens:  # its controls left no token there (calls.run_draft)
                tokens = tokens[: tokens.index(-1)]
            proposals.append(Proposal(tokens, hits))
            sequence.drafted(len(tokens))
        return proposals


def output_hindsight(sequence: SequenceState, hits: list[bool]) -> tuple[int, int]:
    """(right, judged) of the draft's hindsight guesses of the tokens it was just fed (the
    last len(hits) of the sequence; only a greedy row's catch-up has any, see
    wire.hindsight_lengths): whether each equals what greedy decoding produced there.
    Guesses of prompt tokens are no verdicts on output and are skipped."""
    first = len(sequence.token_ids) - len(hits)  # the index of the first guessed token
    outputs = hits[max(0, len(sequence.request.prompt_ids) - first) :]
    return sum(outputs), len(outputs)
