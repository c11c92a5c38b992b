"""Prompt lookup: draft tokens copied from the row's own prompt and output, no model call.

Where an answer copies its input (edit this function, convert this JSON, fix this
paragraph), the tokens that followed the last earlier occurrence of the row's newest n
tokens are a good guess of what comes next (Saxena, "Prompt lookup decoding", 2023; the
n-gram proposer of vLLM and TensorRT-LLM). The index is built incrementally, so a lookup
costs O(1) and an appended token O(number of match lengths), not a scan of the sequence.

`plan_ngram_tokens` decides how many of those proposals each row sends to the verify: it
adds proposed tokens one by one, best expected gain first, while the batch's goodput
(expected tokens per second of a whole iteration) still grows. Each row's acceptance is its
own. `NgramProposer` is prompt lookup as a proposer (specdec/loop/proposers/base.py).

Example: a row whose tokens are [5, 8, 2, 9, 5, 8] has the suffix (5, 8) earlier at
positions 0-1, followed by 2, 9, 5, 8; with k = 3 the lookup proposes [2, 9, 5].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from specdec.loop.controller import AcceptanceWindow, CostCurve
from specdec.loop.proposers.base import Candidate, Proposal, Proposer, TimedStep
from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.calibration import Calibration
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
    width_cost: float = 0.0,
) -> dict[int, int]:
    """Draft tokens per candidate row (row -> k, only rows with k > 0).

    Tokens are taken in order of their expected gain (row r's j-th proposal adds
    prod_{i<=j} rates_r[i] expected tokens), and the plan stops at the prefix of that order
    with the best goodput, (batch_size + gains) / cost, where cost is target_cost(batch_size
    + tokens) plus `width_cost` for each width of rows beyond the single-token one (the
    engine runs an attention call per width: specdec/loop/calibration.py). It is used only
    if that beats plain decoding's batch_size / target_cost(batch_size) by `margin`."""
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
    widths = {1: batch_size}  # rows by tokens verified
    row_widths: dict[int, int] = {}
    for count, (gain, _, row) in enumerate(gains, start=1):
        expected += gain
        width = row_widths.get(row, 1)
        widths[width] -= 1
        if not widths[width]:
            del widths[width]
        row_widths[row] = width + 1
        widths[width + 1] = widths.get(width + 1, 0) + 1
        cost = target_cost(batch_size + count)
        if cost:
            cost += width_cost * (len(widths) - 1)
            if expected / cost > best_goodput:
                best_goodput, best_count = expected / cost, count
    plan: dict[int, int] = {}
    for _, _, row in gains[:best_count]:
        plan[row] = plan.get(row, 0) + 1
    return plan


# The plan must promise this much more goodput than plain decoding: the cost curve and the
# acceptance estimates are noisy, and a lost bet costs verify time.
NGRAM_MARGIN = 1.05
# A row with a match whose lookups have not been verified for this many steps times the
# batch size probes: it proposes its whole lookup, so that every position's acceptance is
# learnt, not only the first's (with one-token probes, where a short verify is dear the plan
# never tried a longer one: float32, 1 row, a cold rewrite burst at 1.03x of k = 0 instead of
# 1.39x). Its acceptance estimate would otherwise never recover from a bad start. Scaled by
# the batch, so that the batch probes about once per NGRAM_PROBE_EVERY steps whatever its
# size: a probe makes the target's rows unequal in length, and such a verify cost 1.5x a
# plain step at 16 rows on a 2-core CPU (one probe every step in a cold 16-stream chat burst
# made adaptive 0.70x of k = 0).
NGRAM_PROBE_EVERY = 16
# ...or as rarely as keeps the probes within this share of plain decoding's time: where a
# verify of more tokens costs much more than a plain step (float32 on 2 cores, 1 row: 86 ms
# against 50, a small matrix product's slow path), a probe every 16 steps cost 4%.
NGRAM_PROBE_BUDGET = 0.01
ROW_WINDOW = 16  # a row's own acceptance window: rows differ, and a request is short
# What every row's lookups are assumed to be worth before any has been verified (a fresh
# server): cautious, so that the first burst's lookups go only where a token costs little
# (a few rows: one verify costs about what one step does) and not across a large batch on
# the strength of a guess; two pseudo-observations, so that the first verdicts rule.
COLD_PRIOR = 0.25


@dataclass
class NgramRow:
    """One row's prompt-lookup state."""

    index: NgramIndex
    proposal: list[int] = field(default_factory=list)  # this step's lookup
    acceptance: AcceptanceWindow | None = None  # the row's own, once it used lookups
    idle: int = 0  # steps with a match that was not verified


class NgramProposer(Proposer):
    name = "ngram"
    calls_model = False

    def __init__(self, config: SchedulerConfig, engines: Engines, target_cost: CostCurve) -> None:
        super().__init__(config, engines, target_cost)
        self.max_k = config.max_draft_tokens
        self.match_lengths = config.ngram_match_lengths
        self.target_cost = target_cost
        self.rows: dict[int, NgramRow] = {}  # by sequence id
        # Every row's lookups, by match length: a 3-token match is a surer guess than one token.
        self.acceptance = {
            n: AcceptanceWindow(self.max_k, prior=COLD_PRIOR) for n in self.match_lengths
        }
        # Whole steady iterations without a model draft, by batch size, then by tokens
        # verified: what the plan prices its tokens by. The target call alone sees neither the
        # loop's own work per proposed token nor what every iteration pays (docs/benchmarks.md,
        # 2026-12-02). One curve for every batch size priced a 16-row step's 20 tokens by
        # 10-row steps that verified 20, which read fewer caches.
        self.iteration_cost: dict[int, CostCurve] = {}
        # What a verify pays for each width of rows beyond the first, by rows (start-up's
        # measurement; none without it): priced by the plan, taken out of the iterations the
        # curves above learn, which count tokens, not widths.
        self.width_cost = CostCurve()

    def _look_up(self, candidate: Candidate) -> NgramRow:
        """The row's lookup of up to max_k tokens, not yet chosen for the verify."""
        sequence = candidate.sequence
        row = self.rows.get(sequence.id)
        if row is None:
            row = self.rows[sequence.id] = NgramRow(NgramIndex(self.match_lengths))
        row.proposal = row.index.propose(sequence.token_ids, candidate.max_k)
        return row

    def plan_exact(self, candidate: Candidate) -> int:
        return len(self._look_up(candidate).proposal)

    def plan(
        self, candidates: list[Candidate], batch_size: int, fixed_ks: list[int]
    ) -> dict[int, int]:
        """Lookups for the rows where they pay: each row's own acceptance (shrunk towards
        every row's) against the measured cost of an iteration by tokens verified. A row
        with a match left unverified for probe_interval() x batch_size steps tries one
        token."""
        options = []
        shared = {n: window.rates() for n, window in self.acceptance.items()}
        for i, candidate in enumerate(candidates):
            row = self._look_up(candidate)
            if row.proposal:
                prior = shared[row.index.match_length]
                rates = row.acceptance.rates(prior) if row.acceptance is not None else prior
                options.append(NgramCandidate(i, len(row.proposal), rates))
        if not options:
            return {}
        plan = plan_ngram_tokens(
            options,
            batch_size,
            self._verify_cost(batch_size),
            NGRAM_MARGIN,
            self.width_cost.estimate(batch_size) or 0.0,
        )
        ks = {}
        probe_every = self.probe_interval(batch_size)
        probed: set[int] = set()  # match lengths probed this step
        for option in options:
            row = self.rows[candidates[option.row].sequence.id]
            k = plan.get(option.row, 0)
            if k == 0:
                row.idle += 1
                length = row.index.match_length
                first = length not in probed and self._unexplored(length)
                if row.idle < probe_every * batch_size and not first:
                    continue
                probed.add(length)
                k = option.max_tokens  # a probe: the whole lookup
            row.idle = 0
            row.proposal = row.proposal[:k]
            ks[option.row] = k
        return ks

    def _unexplored(self, match_length: int) -> bool:
        """No lookup of this match length has been verified on this server yet: one row
        with such a match probes at once (about one probe per match length in the server's
        life), so a fresh server learns what its lookups are worth from evidence, not from
        the cold prior alone, which where a verify is dear never pays for a try."""
        return not self.acceptance[match_length].tried[0]

    def probe_interval(self, batch_size: int) -> int:
        """Steps of the batch between probes: NGRAM_PROBE_EVERY, or more where a probe's
        extra tokens (a whole lookup of max_k) and width would cost more than
        NGRAM_PROBE_BUDGET of plain decoding's time (the target's curve, measured at
        start-up)."""
        plain = self.target_cost.estimate(batch_size, batch_size)
        probe = self.target_cost.estimate(batch_size + self.max_k, batch_size)
        if not plain or probe is None:
            return NGRAM_PROBE_EVERY
        extra = max(0.0, probe - plain) + (self.width_cost.estimate(batch_size) or 0.0)
        return max(NGRAM_PROBE_EVERY, math.ceil(extra / (NGRAM_PROBE_BUDGET * plain)))

    def _verify_cost(self, batch_size: int) -> Callable[[int], float | None]:
        """Seconds of an iteration by tokens verified: whole iterations of this batch size as
        measured where they reach past plain decoding, or else the target call's curve
        (start-up's shape) where that does. Without either, extra tokens are priced at
        nothing, so that one verify is tried and measured (extrapolating from plain decoding
        alone would price each token as a whole row, and lookups would never start). Whole
        iterations of 1 row, up to 4 tokens, once priced a 16-row step's lookups at nothing:
        60 tokens in a cold chat burst's first 16-row step, none accepted."""
        measured = self.iteration_cost.get(batch_size)
        for curve in (measured, self.target_cost):
            if curve is not None and curve.sizes and curve.sizes[-1] > batch_size:
                return partial(curve.estimate, rows=batch_size)
        plain = (measured or self.target_cost).estimate(batch_size, batch_size)
        return lambda num_tokens: plain

    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        return [Proposal(self.rows[s.id].proposal[:k]) for s, k in zip(rows, ks, strict=True)]

    def observe(self, sequence: SequenceState, k: int, num_accepted: int) -> None:
        row = self.rows[sequence.id]
        if row.acceptance is None:
            row.acceptance = AcceptanceWindow(self.max_k, window=ROW_WINDOW)
        row.acceptance.observe(k, num_accepted)
        self.acceptance[row.index.match_length].observe(k, num_accepted)

    def calibrated(self, calibration: Calibration) -> None:
        for rows, seconds in calibration.width_costs().items():
            self.width_cost.calibrate(rows, seconds)

    def observe_iteration(self, step: TimedStep, seconds: float) -> None:
        if not step.model_drafted:
            widths = (self.width_cost.estimate(step.batch_size) or 0.0) * (step.num_widths - 1)
            curve = self.iteration_cost.setdefault(step.batch_size, CostCurve())
            curve.observe(step.num_tokens, seconds - widths)

    def release(self, sequence: SequenceState) -> None:
        self.rows.pop(sequence.id, None)
