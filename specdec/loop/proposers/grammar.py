"""The grammar as a proposer: where a guided row's grammar writes the text itself (the rest of a
JSON key, the quote, colon and space after it, a closing brace), that text is proposed at no
model call (SGLang calls this jump-forward decoding); then, ahead of it, what prompt lookup
finds after it in the row's text (a value copied from the prompt), as far as the grammar
allows.

An offer is, in order:
- forced tokens: each the one token the mask allows, so the target, masked the same way
  (specdec/engines/grammar.py), takes it whatever its logits: greedy or sampled, it is
  accepted unless the row ends first (the end token where the grammar is complete);
- the jump-forward text, as the tokenizer splits it (jump_forward_tokens). Its text is
  certain, its split is not: where the vocabulary spells it more than one way the target
  chooses among them, and may choose another (the verify then rejects the rest, as it would
  a wrong guess);
- prompt lookup's continuation after those, cut where the grammar forbids it.
The cost model (LookupPlanner) learns what an offer's tokens are worth, as for any proposer
without a model call, under a key that says how many of them are the grammar's own (forced
or jump-forward: near-certain; the lookup's are not).

Its state is a matcher per guided row, advanced through the tokens the row commits; rows
without a guide get no offer. With num_draft_tokens = 0 a row gets no proposals at all, so
k = 0 stays plain guided decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.proposers.ngram import NgramIndex
from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig


# Offers' acceptance keys: how many of their tokens are the grammar's own, up to this many.
MAX_GRAMMAR_KEY = 4


def grammar_offer(
    grammars,
    matcher,
    limit: int,
    lookup: Callable[[list[int], int], list[int]] | None = None,
    jump: bool = True,
) -> tuple[list[int], int]:
    """Up to `limit` tokens after the matcher's state, and how many of them are the
    grammar's own: its forced tokens, then (`jump`) the text it writes itself, then
    `lookup(own, room)`'s guess after those, as far as the grammar allows it. The matcher is
    walked once along the offer and left where it was."""
    from specdec.engines.grammar import advance, forced_tokens, jump_forward_tokens

    own = advance(matcher, forced_tokens(matcher, grammars.vocab_size, limit))
    if jump:
        own += jump_forward_tokens(grammars, matcher, limit - len(own))
    guessed = advance(matcher, lookup(own, limit - len(own))) if lookup is not None else []
    walked = len(own) + len(guessed)
    if walked:
        matcher.rollback(walked)
    return own + guessed, len(own)


class GrammarProposer(Proposer):
    name = "grammar"
    calls_model = False
    verdicts_per_probe = 1  # a probe verifies one proposal: one verdict on its first token

    def __init__(self, config: SchedulerConfig, engines: Engines) -> None:
        super().__init__(config, engines)
        self.grammars = getattr(engines, "grammars", None)  # specdec/engines/grammar.py
        self.matchers = None  # by sequence id: each after the row's committed output
        if self.grammars is not None:
            from specdec.engines.grammar import PositionedMatchers

            self.matchers = PositionedMatchers(self.grammars)
        self.proposals: dict[int, list[int]] = {}  # by sequence id: this step's offer
        self.indexes: dict[int, NgramIndex] = {}  # by sequence id: its text, for lookups

    def offer(self, candidate: Candidate) -> Offer:
        sequence = candidate.sequence
        self.proposals.pop(sequence.id, None)
        request = sequence.request
        if request.guide is None or self.matchers is None or candidate.max_k <= 0:
            return Offer(0)
        output = sequence.token_ids[len(request.prompt_ids) :]
        # None once the row ended or left the grammar (which the engines' masks never let it)
        matcher = self.matchers.at(sequence.id, request.guide.pair, request.end_id, output)
        if matcher is None:
            return Offer(0)
        index = self.indexes.setdefault(sequence.id, NgramIndex())
        proposal, num_own = grammar_offer(
            self.matchers.grammars,
            matcher,
            candidate.max_k,
            lambda own, room: index.propose(sequence.token_ids, room, then=own),
        )
        self.proposals[sequence.id] = proposal
        return Offer(len(proposal), min(num_own, MAX_GRAMMAR_KEY) if proposal else None)

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        return [Proposal(self.proposals[s.id][:k]) for s, k in zip(rows, ks, strict=True)]

    def release(self, sequence: SequenceState) -> None:
        if self.matchers is not None:
            self.matchers.drop(sequence.id)
        self.proposals.pop(sequence.id, None)
        self.indexes.pop(sequence.id, None)
