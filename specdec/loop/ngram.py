"""Prompt lookup: draft tokens copied from the row's own prompt and output, no model call.

Where an answer copies its input (edit this function, convert this JSON, fix this
paragraph), the tokens that followed the last earlier occurrence of the row's newest n
tokens are a good guess of what comes next (Saxena, "Prompt lookup decoding", 2023; the
n-gram proposer of vLLM and TensorRT-LLM). The index is built incrementally, so a lookup
costs O(1) and an appended token O(number of match lengths), not a scan of the sequence.

`plan_ngram_tokens` decides how many of those proposals each row sends to the verify: it
adds proposed tokens one by one, best expected gain first, while the batch's goodput
(expected tokens per second of target time) still grows. Each row's acceptance is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DEFAULT_MATCH_LENGTHS = (3, 2, 1)  # tried longest first: a longer match is a surer guess


@dataclass
class NgramIndex:
    """For each match length n, the n-gram ending at each position -> the position after
    its latest occurrence that has a following token."""

    match_lengths: tuple[int, ...] = DEFAULT_MATCH_LENGTHS
    match_length: int = 0  # n of the last proposal's match (0: none)
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # positions < this have their n-grams in _latest

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the
        longest matching suffix of `token_ids` (prompt + output); [] without a match."""
        self.match_length = 0
        if max_tokens <= 0:
            return []
        self._extend(token_ids)
        length = len(token_ids)
        for n in self.match_lengths:
            if n >= length:
                continue
            start = self._latest.get(tuple(token_ids[length - n :]))
            if start is not None:
                self.match_length = n
                return list(token_ids[start : start + max_tokens])
        return []

    def _extend(self, token_ids: Sequence[int]) -> None:
        # An n-gram ending before the last position has a following token to propose; the
        # suffix itself (ending at the last position) is the key being looked up.
        for end in range(max(self._indexed, 1), len(token_ids)):
            for n in self.match_lengths:
                if n <= end:
                    self._latest[tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(token_ids))


@dataclass
class NgramCandidate:
    """A row that can use prompt lookup this iteration."""

    row: int
    max_tokens: int  # proposals available (the match's length, capped by the row's k)
    rates: list[float]  # the row's acceptance per draft position, given the ones before


def plan_ngram_tokens(
    candidates: list[NgramCandidate],
    batch_size: int,
    target_cost: Callable[[int], float | None],  # seconds of a verify of this many tokens
    margin: float,
) -> dict[int, int]:
    """Draft tokens per candidate row (row -> k, only rows with k > 0).

    Tokens are taken in order of their expected gain (row r's j-th proposal adds
    prod_{i<=j} rates_r[i] expected tokens), and the plan stops at the prefix of that order
    with the best goodput, (batch_size + gains) / target_cost(batch_size + tokens). It is
    used only if that beats plain decoding's batch_size / target_cost(batch_size) by
    `margin`."""
    gains = []
    for candidate in candidates:
        survive = 1.0
        for j in range(candidate.max_tokens):
            survive *= candidate.rates[min(j, len(candidate.rates) - 1)]
            gains.append((survive, -j, candidate.row))
    plain_cost = target_cost(batch_size)
    if not gains or not plain_cost:
        return {}
    gains.sort(reverse=True)  # within a row gains only fall, so each row takes a prefix
    plain_goodput = batch_size / plain_cost
    best_goodput, best_count, expected = plain_goodput * margin, 0, float(batch_size)
    for count, (gain, _, _) in enumerate(gains, start=1):
        expected += gain
        cost = target_cost(batch_size + count)
        if cost and expected / cost > best_goodput:
            best_goodput, best_count = expected / cost, count
    plan: dict[int, int] = {}
    for _, _, row in gains[:best_count]:
        plan[row] = plan.get(row, 0) + 1
    return plan
