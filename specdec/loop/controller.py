"""Adaptive k: choose the draft length that maximises goodput at the current load.

Speculation spends spare compute; under load there is none, and a fixed k gets slower than
plain decoding. Acceptance alone cannot see that, so the controller maximises goodput,

    goodput(k) = expected emitted tokens / expected step time,

from what it measures online: the acceptance rate at each draft position (given that the
positions before it were accepted) over a recent window, the draft's cost per step at the
current number of draft rows, and the target's cost per call by the number of tokens it
verifies. Expected tokens for a row at k: 1 + sum_{j<=k} prod_{i<=j} alpha_i
(Leviathan et al., arXiv 2211.17192, section 3.4, with per-position rates).
k = 0 skips the draft call, so it costs what plain decoding costs.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


class CostCurve:
    """Seconds per call by a size (tokens, rows). Its shape: points measured at start-up
    (`calibrate`), or else learnt online (an EMA per size observed); linear interpolation
    between sizes, a least-squares line beyond them.

    Extrapolation errs towards trying a size; once tried, the size is measured, so a wrong
    guess corrects itself in one iteration (a pessimistic guess would never be tested).

    Start-up measures every size on short contexts at once. Serving's calls cost more, and
    by about the same at every size for a given number of rows: each row reads its whole
    cache once per call, however many tokens it verifies. So once calibrated, what serving
    observes moves the level, not the shape: per batch-size bucket, an EMA of the seconds per
    row a call costs beyond the start-up curve. (Learnt as points beside the start-up ones,
    one row per token at 64 rows came from serving on long contexts and two from start-up on
    short ones, and a draft token per row looked nearly free: docs/benchmarks.md.)
    """

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.sizes: list[int] = []
        self.seconds: dict[int, float] = {}
        self.calibrated = False
        self.extra_per_row: dict[int, float] = {}  # by batch bucket, once calibrated

    def calibrate(self, size: int, seconds: float) -> None:
        """A start-up measurement: a point of the shape (two at one size are averaged)."""
        self.calibrated = True
        self._add(size, seconds, 0.5)

    def observe(self, size: int, seconds: float, rows: int | None = None) -> None:
        """A call while serving, of `rows` rows (default: `size`, a curve by rows)."""
        shape = self._shape(size) if self.calibrated else None
        if shape is None:
            self._add(size, seconds, self.weight)
            return
        rows = rows or size
        extra = (seconds - shape) / rows
        bucket = batch_bucket(rows)
        previous = self.extra_per_row.get(bucket)
        self.extra_per_row[bucket] = (
            extra if previous is None else previous + self.weight * (extra - previous)
        )

    def _add(self, size: int, seconds: float, weight: float) -> None:
        if size in self.seconds:
            self.seconds[size] += weight * (seconds - self.seconds[size])
        else:
            bisect.insort(self.sizes, size)
            self.seconds[size] = seconds

    def _line(self) -> tuple[float, float]:
        xs = self.sizes
        ys = [self.seconds[x] for x in xs]
        if len(xs) == 1:
            return 0.0, ys[0] / xs[0]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        slope = max(0.0, covariance / var)
        return max(0.0, mean_y - slope * mean_x), slope

    def estimate(self, size: int, rows: int | None = None) -> float | None:
        """Seconds of a call of `size` over `rows` rows (default: `size`)."""
        shape = self._shape(size)
        if shape is None or not self.extra_per_row:
            return shape
        rows = rows or size
        bucket = batch_bucket(rows)
        extra = self.extra_per_row.get(bucket)
        if extra is None:  # the nearest bucket measured
            nearest = min(
                self.extra_per_row, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b)
            )
            extra = self.extra_per_row[nearest]
        return max(0.1 * shape, shape + rows * extra)

    def _shape(self, size: int) -> float | None:
        if not self.sizes:
            return None
        if size in self.seconds:
            return self.seconds[size]
        i = bisect.bisect_left(self.sizes, size)
        if 0 < i < len(self.sizes):
            lo, hi = self.sizes[i - 1], self.sizes[i]
            share = (size - lo) / (hi - lo)
            return self.seconds[lo] + share * (self.seconds[hi] - self.seconds[lo])
        intercept, slope = self._line()
        guess = intercept + slope * size
        if i == 0:
            return min(guess, self.seconds[self.sizes[0]])
        return max(guess, self.seconds[self.sizes[-1]])


class AcceptanceWindow:
    """alpha_i: P(draft token i accepted | tokens before it accepted), over the last few dozen
    observations of each position.

    The window decays per observation, not per iteration: while nothing is drafted the
    estimate stays what it was (a probe refreshes it), instead of fading back to the prior
    and luring the controller into speculating again on the strength of one lucky probe.
    A weak prior (`prior_weight` pseudo-observations of `prior`) keeps one sample from
    reading as certainty. A cold prior (`cold_weight` pseudo-observations of `cold_prior`
    at the first position) is where a fresh window starts; unlike the weak prior it fades
    like an observation does, so it rules only until there is evidence: a few lucky first
    samples on a fresh server do not read as a high rate, and a long-running one is judged by
    its own. Only the first position has one: probes observe it without drafting, while a
    later position is observed only by drafting that far, which a cold prior there would
    stop for good.
    """

    def __init__(
        self,
        max_k: int,
        window: int = 48,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        cold_prior: float = 0.0,
        cold_weight: float = 0.0,
    ) -> None:
        self.decay = 1.0 - 1.0 / window
        self.prior = prior
        self.prior_weight = prior_weight
        self.cold_prior = cold_prior
        self.cold = cold_weight  # what is left of the cold prior (first position)
        self.accepted = [0.0] * max_k
        self.tried = [0.0] * max_k

    def observe(self, k: int, num_accepted: int) -> None:
        for i in range(min(k, num_accepted + 1)):  # positions after a rejection are unseen
            self.tried[i] = self.tried[i] * self.decay + 1
            self.accepted[i] = self.accepted[i] * self.decay + (i < num_accepted)
        if k > 0:
            self.cold *= self.decay

    def observe_first(self, hits: int, total: int) -> None:
        """`total` samples of position 1 at once (a draft's hindsight guesses), `hits` right;
        weighted as if they had come one by one in an even mix."""
        if total <= 0:
            return
        kept = self.decay**total
        weight = (1 - kept) / (1 - self.decay)  # sum of decay**i, i < total
        self.tried[0] = self.tried[0] * kept + weight
        self.accepted[0] = self.accepted[0] * kept + weight * hits / total
        self.cold *= kept

    def rates(self, prior: list[float] | None = None) -> list[float]:
        """Per position; an unseen position borrows the rate of the last seen one. `prior`:
        per-position rates to shrink towards instead of the constant one (a row's own
        window shrinks towards every row's). What is left of the cold prior counts at the
        first position, seen or not."""
        rates, last = [], self.prior
        for i, (accepted, tried) in enumerate(zip(self.accepted, self.tried, strict=True)):
            position_prior = self.prior if prior is None else prior[i]
            cold = self.cold if i == 0 else 0.0
            if tried > 0 or cold > 0:
                pseudo = position_prior * self.prior_weight + self.cold_prior * cold
                last = (accepted + pseudo) / (tried + self.prior_weight + cold)
            elif prior is not None:
                last = position_prior
            rates.append(last)
        return rates


def expected_tokens(rates: list[float], k: int) -> float:
    """Expected tokens one row emits per pass with k draft tokens."""
    total, survive = 1.0, 1.0
    for alpha in rates[:k]:
        survive *= alpha
        total += survive
    return total


ITERATION_EMA = 0.2
# Where the constants below come from: docs/benchmarks.md, "The controller's constants".
# k > 0 must promise 10% more goodput than k = 0 (25% where the per-call models price the
# two), and 3% more than a smaller k > 0: near break-even the estimate of alpha is noisy,
# and every switch to drafting pays a catch-up.
SPECULATION_MARGIN = 1.10
EXPLORE_MARGIN = 1.25
LONGER_K_MARGIN = 1.03
# First-position verdicts before the controller speculates at all, and probes space out:
# one lucky probe must not read as high acceptance.
EARLY_SAMPLES = 8
EARLY_PROBE_EVERY = 4
# Where the draft's acceptance starts on a fresh server: 16 pseudo-observations of 0.25, which
# fade as verdicts come (AcceptanceWindow's cold prior). The first probes of a fresh server
# see the opening of its first answer, which a draft guesses far better than what follows (a
# cold chat burst: 8 early hindsight verdicts read as alpha > 0.7, then the draft's own
# tokens were accepted 2 times in 9), so that evidence alone must not start drafting.
DRAFT_COLD_PRIOR = 0.25
DRAFT_COLD_WEIGHT = 16.0
# Probes may cost at most this share of plain decoding's time. A probe costs the draft
# catching up on every token since its last call, and brings up to HINDSIGHT_TOKENS
# first-position verdicts, so rare probes still see plenty.
PROBE_BUDGET = 0.0025
STALE_AFTER = 256  # iterations after which a measured iteration cost is guessed again


def batch_bucket(batch_size: int) -> int:
    """Exact up to 8 rows (cost changes fastest there), then powers of two."""
    return batch_size if batch_size <= 8 else 1 << (batch_size - 1).bit_length()


@dataclass
class Choice:
    k: int  # for every adaptive row
    # Refresh alpha_1 this iteration while the rows decode plainly: one greedy adaptive row's
    # draft catches up and guesses the tokens it missed (or, with no greedy row, one row
    # proposes a token).
    probe: bool
    goodput: float  # expected tokens per second of the chosen plan (0 if costs unknown)


class AdaptiveController:
    def __init__(
        self, max_k: int, target_cost: CostCurve | None = None, probe_every: int = 64
    ) -> None:
        """`target_cost`: the target call's seconds by tokens verified, where the loop
        measures it for every proposer (a curve of its own if None)."""
        self.max_k = max_k
        self.probe_every = probe_every
        self.acceptance = AcceptanceWindow(
            max_k, cold_prior=DRAFT_COLD_PRIOR, cold_weight=DRAFT_COLD_WEIGHT
        )
        self.draft_step_cost = CostCurve()  # by number of draft rows
        self.target_cost = CostCurve() if target_cost is None else target_cost
        # Whole iterations as they really cost, by (batch-size bucket, k): catch-up draft
        # calls, transfers and bookkeeping that the per-call curves do not see.
        self.iteration_cost: dict[tuple[int, int], tuple[float, int]] = {}
        # Measured over modelled cost, by (batch-size bucket, k), kept after the measurement
        # goes stale: once a k proved dearer than its model, a guess at it is corrected.
        self.model_error: dict[tuple[int, int], float] = {}
        # Probe iterations as they really cost, by batch-size bucket: what spaces probes out.
        self.probe_cost: dict[int, float] = {}
        self.iteration = 0
        self.iterations_without_draft = 0

    # -- measurements ------------------------------------------------------------------------
    def observe_draft(self, num_rows: int, num_steps: int, seconds: float) -> None:
        self.draft_step_cost.observe(num_rows, seconds / num_steps)

    def observe_target(self, num_tokens: int, seconds: float, rows: int | None = None) -> None:
        self.target_cost.observe(num_tokens, seconds, rows)

    def observe_verdict(self, k: int, num_accepted: int) -> None:
        self.acceptance.observe(k, num_accepted)

    def observe_hindsight(self, hits: int, total: int) -> None:
        """The draft's hindsight guesses of `total` tokens greedy plain decoding produced,
        `hits` of them right: each is a first-position verdict that needed no verify."""
        self.acceptance.observe_first(hits, total)

    def observe_iteration(self, batch_size: int, k: int, seconds: float) -> None:
        """A whole iteration in which every adaptive row used k."""
        key = (batch_bucket(batch_size), k)
        modelled = self._modelled_cost(k, batch_size, [])
        if modelled:
            error = seconds / modelled
            previous_error = self.model_error.get(key, error)
            self.model_error[key] = previous_error + ITERATION_EMA * (error - previous_error)
        previous = self.iteration_cost.get(key)
        if previous is not None and self.iteration - previous[1] < STALE_AFTER:
            seconds = previous[0] + ITERATION_EMA * (seconds - previous[0])
        self.iteration_cost[key] = (seconds, self.iteration)

    def observe_probe(self, batch_size: int, seconds: float) -> None:
        """A whole iteration in which one adaptive row probed and the others used k = 0."""
        key = batch_bucket(batch_size)
        previous = self.probe_cost.get(key)
        self.probe_cost[key] = (
            seconds if previous is None else previous + ITERATION_EMA * (seconds - previous)
        )

    def end_iteration(self, drafted: bool) -> None:
        self.iteration += 1
        self.iterations_without_draft = 0 if drafted else self.iterations_without_draft + 1

    # -- the choice --------------------------------------------------------------------------
    def choose(self, num_adaptive: int, fixed_ks: list[int]) -> Choice:
        """k for the adaptive rows, given the k of the rows that fixed their own."""
        if num_adaptive == 0:
            return Choice(0, False, 0.0)
        if self.acceptance.tried[0] < EARLY_SAMPLES:  # too little known: probe, do not draft
            return Choice(0, self.iterations_without_draft >= EARLY_PROBE_EVERY, 0.0)
        rates = self.acceptance.rates()
        batch_size = num_adaptive + len(fixed_ks)
        plain_tokens = self._tokens(0, num_adaptive, fixed_ks, rates)
        plain_modelled = self._modelled_cost(0, num_adaptive, fixed_ks)
        if plain_modelled is None:  # the target's cost is not known yet
            return Choice(0, False, 0.0)
        plain_measured = self._measured(0, batch_size)
        best = Choice(0, False, plain_tokens / (plain_measured or plain_modelled))
        best_gain = 1.0
        for k in range(1, self.max_k + 1):
            # Like against like: two whole iterations as measured (they include the glue's
            # work between steps), or else two per-call models (which do not). A model
            # against a measurement favours whichever k has not been measured.
            measured = self._measured(k, batch_size)
            cost: float
            if measured is not None and plain_measured is not None:
                cost, plain_cost, margin = measured, plain_measured, SPECULATION_MARGIN
            else:
                modelled = self._modelled_cost(k, num_adaptive, fixed_ks)
                if modelled is None:  # the draft's cost never measured: try it once
                    return Choice(k, False, 0.0)
                cost = modelled
                # A guess, corrected by how far off the models were when this k and k = 0
                # were last measured here (both or neither: one corrected side against a raw
                # one is a model against a measurement again). Without it, every time the
                # measurement went stale the same optimistic model would try again.
                bucket = batch_bucket(batch_size)
                error = self.model_error.get((bucket, k))
                plain_error = self.model_error.get((bucket, 0))
                plain_cost = plain_modelled
                if error is not None and plain_error is not None:
                    cost, plain_cost = cost * error, plain_cost * plain_error
                margin = EXPLORE_MARGIN
            # Speculating must beat plain decoding by a margin, so that noise alone never tips
            # it, and a guess must promise more. Among the k that clear it, a larger k must
            # beat a smaller one by a little.
            goodput = self._tokens(k, num_adaptive, fixed_ks, rates) / cost
            gain = goodput / (plain_tokens / plain_cost)
            if gain > margin and gain > best_gain * LONGER_K_MARGIN:
                best, best_gain = Choice(k, False, goodput), gain
        # Probe while there is no drafting: often while alpha rests on a few samples (one
        # unlucky rejection must not shut speculation off for long), rarely after that.
        if best.k == 0 and self.iterations_without_draft >= self._probe_interval(
            batch_size, plain_measured
        ):
            best.probe = True
        return best

    def _probe_interval(self, batch_size: int, plain: float | None) -> int:
        """Iterations without drafting between probes: every `probe_every`, or as rarely as
        keeps the probes' extra cost within PROBE_BUDGET of plain decoding's time (`plain`:
        a whole k = 0 iteration as measured lately)."""
        if self.acceptance.tried[0] < EARLY_SAMPLES:
            return EARLY_PROBE_EVERY
        probe = self.probe_cost.get(batch_bucket(batch_size))
        if probe is None or plain is None:
            return self.probe_every
        extra = max(0.0, probe - plain)
        return max(self.probe_every, math.ceil(extra / (PROBE_BUDGET * plain)))

    def _measured(self, k: int, batch_size: int) -> float | None:
        """Seconds of a whole iteration at this batch size and k, if measured lately."""
        cell = self.iteration_cost.get((batch_bucket(batch_size), k))
        if cell is None or self.iteration - cell[1] >= STALE_AFTER:
            return None
        return cell[0]

    @staticmethod
    def _tokens(k: int, num_adaptive: int, fixed_ks: list[int], rates) -> float:
        """Expected tokens the batch emits in one pass with the adaptive rows at k."""
        tokens = num_adaptive * expected_tokens(rates, k)
        return tokens + sum(expected_tokens(rates, f) for f in fixed_ks)

    def _modelled_cost(self, k: int, num_adaptive: int, fixed_ks: list[int]) -> float | None:
        """Seconds of the draft and target calls of one pass, from the per-call curves."""
        verified = num_adaptive * (k + 1) + sum(f + 1 for f in fixed_ks)
        target = self.target_cost.estimate(verified, num_adaptive + len(fixed_ks))
        if target is None:
            return None
        draft_rows = (num_adaptive if k else 0) + sum(1 for f in fixed_ks if f)
        if not draft_rows:
            return target
        step = self.draft_step_cost.estimate(draft_rows)
        if step is None:
            return None
        return target + step * max([k] + fixed_ks)
