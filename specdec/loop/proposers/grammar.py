"""The grammar as a proposer: where a guided row's grammar leaves no choice (the rest of a JSON
key, the quote and colon after it, a closing brace), those tokens are proposed, at no model
call (SGLang calls this jump-forward decoding); then, ahead of them, what prompt lookup finds
after them in the row's text (a value copied from the prompt), as far as the grammar allows.

A token is proposed only where the mask allows that one token alone, so the target, masked
the same way (specdec/engines/grammar.py), takes it whatever its logits: greedy or sampled,
the proposal is accepted unless the row ends first. That is why this proposer reads the mask
rather than xgrammar's jump-forward string: a forced string that the vocabulary splits more
than one way is a choice for the target, not a certainty. The cost model (LookupPlanner)
still learns what its tokens are worth, as for any proposer without a model call, under a
key that says how many of an offer's tokens are forced (those are certain, the lookup's are
not).

Its state is a matcher per guided row, advanced through the tokens the row commits; rows
without a guide get no offer. With num_draft_tokens = 0 a row gets no proposals at all, so
k = 0 stays plain guided decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.proposers.ngram import NgramIndex
from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig


# Offers' acceptance keys: how many of their tokens are forced, up to this many.
MAX_FORCED_KEY = 4


def allowed_prefix(matcher, forced: list[int], lookup: list[int]) -> list[int]:
    """The longest prefix of `lookup` the grammar allows after `forced` (the matcher is left
    where it was)."""
    for token in forced:
        matcher.accept_token(token)  # forced: always allowed
    kept = []
    for token in lookup:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            break
        kept.append(int(token))
    accepted = len(forced) + len(kept)
    if accepted:
        matcher.rollback(accepted)
    return kept


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
        from specdec.engines.grammar import forced_tokens

        forced = forced_tokens(matcher, self.matchers.grammars.vocab_size, candidate.max_k)
        index = self.indexes.setdefault(sequence.id, NgramIndex())
        lookup = index.propose(sequence.token_ids, candidate.max_k - len(forced), then=forced)
        proposal = forced + allowed_prefix(matcher, forced, lookup)
        self.proposals[sequence.id] = proposal
        return Offer(len(proposal), min(len(forced), MAX_FORCED_KEY) if proposal else None)

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        return [Proposal(self.proposals[s.id][:k]) for s, k in zip(rows, ks, strict=True)]

    def release(self, sequence: SequenceState) -> None:
        if self.matchers is not None:
            self.matchers.drop(sequence.id)
        self.proposals.pop(sequence.id, None)
        self.indexes.pop(sequence.id, None)
