"""Prompt lookup: draft tokens copied from the row's own prompt and output, no model call.

Where an answer copies its input (edit this function, convert this JSON, fix this
paragraph), the tokens that followed the last earlier occurrence of the row's newest n
tokens are a good guess of what comes next (Saxena, "Prompt lookup decoding", 2023; the
n-gram proposer of vLLM and TensorRT-LLM). The index is built incrementally, so a lookup
costs O(1) and an appended token O(number of match lengths), not a scan of the sequence.

How many of those proposals each row sends to the verify is the cost model's choice
(specdec/loop/economics.py, LookupPlanner), by each row's acceptance under its match length:
a 3-token match is a surer guess than one token.

Example: a row whose tokens are [5, 8, 2, 9, 5, 8] has the suffix (5, 8) earlier at
positions 0-1, followed by 2, 9, 5, 8; with k = 3 the lookup proposes [2, 9, 5].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig

DEFAULT_MATCH_LENGTHS = (3, 2, 1)  # tried longest first: a longer match is a surer guess


@dataclass
class NgramIndex:
    """For each match length n, the n-gram ending at each position -> the position after
    its latest occurrence that has a following token."""

    match_lengths: tuple[int, ...] = DEFAULT_MATCH_LENGTHS
    match_length: int = 0  # n of the last proposal's match (0: none)
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # positions < this have their n-grams in _latest

    def propose(
        self, token_ids: Sequence[int], max_draft_tokens: int, then: Sequence[int] = ()
    ) -> list[int]:
        """Up to `max_draft_tokens` tokens that followed the latest earlier occurrence of the
        longest matching suffix of `token_ids` (prompt + output) followed by `then` (tokens
        proposed ahead of these, looked up but not indexed); [] without a match."""
        self.match_length = 0
        if max_draft_tokens <= 0:
            return []
        self._extend(token_ids)
        text = list(token_ids[-max(self.match_lengths) :]) + list(then) if then else token_ids
        length = len(text)
        for n in self.match_lengths:
            if n >= length or n >= len(token_ids) + len(then):
                continue
            start = self._latest.get(tuple(text[length - n :]))
            if start is not None:
                self.match_length = n
                return list(token_ids[start : start + max_draft_tokens])
        return []

    def _extend(self, token_ids: Sequence[int]) -> None:
        # An n-gram ending before the last position has a following token to propose; the
        # suffix itself (ending at the last position) is the key being looked up.
        for end in range(max(self._indexed, 1), len(token_ids)):
            for n in self.match_lengths:
                if n <= end:
                    self._latest[tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(token_ids))


class NgramProposer(Proposer):
    name = "ngram"
    calls_model = False
    verdicts_per_probe = 1  # a probe verifies one lookup: one verdict on its first token

    def __init__(self, config: SchedulerConfig, engines: Engines) -> None:
        super().__init__(config, engines)
        self.match_lengths = config.ngram_match_lengths
        self.indexes: dict[int, NgramIndex] = {}  # by sequence id
        self.lookups: dict[int, list[int]] = {}  # by sequence id: this step's lookup

    def offer(self, candidate: Candidate) -> Offer:
        """The row's lookup of up to max_k tokens, under its match length."""
        sequence = candidate.sequence
        index = self.indexes.get(sequence.id)
        if index is None:
            index = self.indexes[sequence.id] = NgramIndex(self.match_lengths)
        lookup = self.lookups[sequence.id] = index.propose(sequence.token_ids, candidate.max_k)
        return Offer(len(lookup), index.match_length)

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        return [Proposal(self.lookups[s.id][:k]) for s, k in zip(rows, ks, strict=True)]

    def release(self, sequence: SequenceState) -> None:
        self.indexes.pop(sequence.id, None)
        self.lookups.pop(sequence.id, None)
