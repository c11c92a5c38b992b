"""Suffix decoding: draft tokens from what followed the row's newest tokens in earlier
requests' text and in its own, no model call (Oliaro et al., arXiv 2411.04975).

Agents call the same tools in the same formats, pipelines run one template over many inputs:
answers there repeat *other requests'* text, which prompt lookup (ngram.py) never sees. This
proposer walks two tables of counts (specdec/loop/suffix_store.py), each from the longest
context of the row's tail that it has seen, along the most frequent continuation while the
product of frequencies stays above MIN_PROBABILITY, so a surer match proposes further:
- the shared store (one per server, within SUFFIX_STORE_BYTES, oldest text evicted first):
  every request's last STORED_PROMPT_TOKENS prompt tokens and its output, as committed;
- the row's own prompt and output.
The walk with more expected tokens is offered. Its acceptance key says where it came from
and how sure its first token was, so the cost model (LookupPlanner) learns what each kind is
worth and takes a row's tokens only where they pay.

What feeds the store, and why: every token the target committed, from every row whatever its
proposer, as soon as the step commits it (concurrent requests of one template learn from
each other), and whatever the request's end (finished, cancelled, failed): each token is the
target's own output after its context, so it predicts as well either way. The store changes
only what is proposed, never what is emitted. A row reads and feeds only its own cache_salt's
text.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.loop.proposers.base import Candidate, Offer, Proposal, Proposer
from specdec.loop.sequence import CacheCopy, SequenceState
from specdec.loop.suffix_store import Continuation, Document, SuffixIndex, SuffixStore

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig

DEFAULT_STORE_BYTES = 128 << 20
# A continuation is proposed while the product of its frequencies is at least this.
MIN_PROBABILITY = 0.1
# A request's prompt tokens the store keeps before its output: how answers to such prompts
# began (the rest of a prompt is the row's own text only).
STORED_PROMPT_TOKENS = 64
# Offers' acceptance keys: the first token's frequency bucket, and the source.
FREQUENCY_BUCKETS = (0.5, 0.67, 0.8)  # edges: below 0.5, a context seen once, twice, more
SHARED_KEY = len(FREQUENCY_BUCKETS) + 1  # added to a bucket when the shared store proposes


def offer_key(continuation: Continuation, shared: bool) -> int:
    bucket = bisect.bisect_right(FREQUENCY_BUCKETS, continuation.probabilities[0])
    return bucket + (SHARED_KEY if shared else 0)


@dataclass
class RowText:
    """A row's own table, and its document in the shared store."""

    own: SuffixIndex
    document: Document
    num_indexed: int = 0  # of its tokens, those in `own`
    num_stored: int = 0  # of its tokens, those fed to the store


class SuffixProposer(Proposer):
    name = "suffix"
    calls_model = False
    verdicts_per_probe = 1  # a probe verifies one proposal: one verdict on its first token

    def __init__(self, config: SchedulerConfig, engines: Engines) -> None:
        super().__init__(config, engines)
        self.store = SuffixStore(config.suffix_store_bytes)
        self.rows: dict[int, RowText] = {}  # by sequence id
        self.walks: dict[int, Continuation] = {}  # by sequence id: this step's offer

    def offer(self, candidate: Candidate) -> Offer:
        sequence = candidate.sequence
        text = self._row(sequence)
        tokens = sequence.token_ids
        text.own.add_from(tokens, text.num_indexed)
        text.num_indexed = len(tokens)
        own = text.own.walk(tokens, candidate.max_k, MIN_PROBABILITY)
        salt = sequence.request.cache_salt
        shared = self.store.walk(salt, tokens, candidate.max_k, MIN_PROBABILITY)
        best = shared if shared.expected_tokens > own.expected_tokens else own
        self.walks[sequence.id] = best
        if not best.token_ids:
            return Offer(0)
        return Offer(len(best.token_ids), offer_key(best, best is shared))

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        return [Proposal(self.walks[s.id].token_ids[:k]) for s, k in zip(rows, ks, strict=True)]

    def committed(self, batch: list[SequenceState]) -> None:
        """Feeds the store each row's tokens committed since it last fed it."""
        for sequence in batch:
            text = self._row(sequence)
            new = sequence.token_ids[text.num_stored :]
            if new:
                text.document = self.store.extend(text.document, new)
                text.num_stored = len(sequence.token_ids)

    def release(self, sequence: SequenceState) -> None:
        self.rows.pop(sequence.id, None)
        self.walks.pop(sequence.id, None)

    def _row(self, sequence: SequenceState) -> RowText:
        text = self.rows.get(sequence.id)
        if text is None:
            prompt = sequence.request.prompt_ids
            stored = max(0, len(prompt) - STORED_PROMPT_TOKENS)  # its first stored token
            document = self.store.open(sequence.request.cache_salt, prompt[:stored])
            text = self.rows[sequence.id] = RowText(
                SuffixIndex(self.store.depth), document, num_stored=stored
            )
        return text
