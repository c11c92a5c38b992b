"""The cost model of speculation: what a step costs, what each proposer's tokens are worth,
when they are worth trying, and the margins that keep noise from tipping a choice.

Every proposer is priced here, by one model; a proposer only proposes and says what it
observed (specdec/loop/proposers/). The quantity every choice maximises is goodput,

    goodput = expected tokens the batch emits / expected seconds of the whole iteration,

where a row with k draft tokens emits 1 + sum_{j<=k} prod_{i<=j} alpha_i tokens in
expectation (Leviathan et al., arXiv 2211.17192, section 3.4, with per-position rates).
- `Costs`: the target call by tokens verified (its shape measured at start-up, its level
  while serving), what one more width of rows adds to a verify, the draft model's step by
  rows, the loop's own work beyond its engine calls (`HostCost`), and whole steady
  iterations, which see the loop's own work too.
- `AcceptanceWindow`: alpha_i = P(draft token i accepted | the ones before accepted) over a
  decaying window; one per proposer and key (prompt lookup: the match length), and for a
  proposer whose rows differ one per row as well.
- Two cost structures, one per kind of proposer. A model proposer's rows share one k
  (`ModelPlanner`): one call runs the longest row's steps for all of them. A proposer
  without a model call costs only the tokens it adds to the verify, so its tokens are taken
  row by row, best expected gain first (`LookupPlanner`).
- Exploration: a key that no verdict has reached probes at once; after that, probes come
  every PROBE_EVERY iterations without speculation, or as rarely as keeps them within
  PROBE_BUDGET of plain decoding's time.

Where the constants below come from: docs/benchmarks.md, "Where the constants come from".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from specdec.loop.calibration import Calibration
    from specdec.loop.timing import EngineCall

# A new measurement's weight in a running average of costs.
EMA_WEIGHT = 0.2
# Iterations after which a measured whole-iteration cost no longer decides alone.
STALE_AFTER = 256
# Verdicts a shared acceptance window remembers (each decays it by 1 - 1/WINDOW)...
WINDOW = 48
# ...and a row's own: rows differ, and a request is short.
ROW_WINDOW = 16
# Acceptance assumed before evidence: cautious, so that a fresh server speculates only
# where a token costs little.
COLD_PRIOR = 0.25
# Pseudo-verdicts of the prior at every position: one sample does not read as certainty.
PRIOR_WEIGHT = 2.0
# At the first position the cold prior weighs this many probes' verdicts as well, fading
# as evidence comes: a fresh server's first probes see the opening of its first answer,
# which a draft guesses far better than what follows.
COLD_PROBES = 0.5
# Speculation must promise this much more goodput than plain decoding: the costs and the
# acceptance estimates are noisy, and a lost bet costs verify time.
SPECULATION_MARGIN = 1.05
# ...and this much where a model proposer's k is priced by per-call models alone, which miss
# the catch-up calls and the glue's work that a drafting iteration adds.
EXPLORE_MARGIN = 1.25
# A model proposer's larger k must beat a smaller one by this: every switch to drafting
# pays a catch-up.
LONGER_K_MARGIN = 1.03
# Iterations without speculation between probes, at least...
PROBE_EVERY = 16
# ...and as many more as keep the probes' extra cost within this share of plain decoding.
PROBE_BUDGET = 0.01


Key = TypeVar("Key")


def update_average(averages: dict[Key, float], key: Key, value: float) -> None:
    """A running average at `key` (a new value weighs EMA_WEIGHT), started at its first."""
    previous = averages.get(key)
    averages[key] = value if previous is None else previous + EMA_WEIGHT * (value - previous)


def batch_bucket(batch_size: int) -> int:
    """Exact up to 8 rows (cost changes fastest there), then powers of two."""
    return batch_size if batch_size <= 8 else 1 << (batch_size - 1).bit_length()


def expected_tokens(rates: list[float], k: int) -> float:
    """Expected tokens one row emits per pass with k draft tokens."""
    total, survive = 1.0, 1.0
    for alpha in rates[:k]:
        survive *= alpha
        total += survive
    return total


def probe_interval(plain: float | None, probe: float | None) -> int:
    """Iterations without speculation between two probes, given the seconds of a plain
    iteration and of a probing one (None: not known yet)."""
    if not plain or probe is None:
        return PROBE_EVERY
    extra = max(0.0, probe - plain)
    return max(PROBE_EVERY, math.ceil(extra / (PROBE_BUDGET * plain)))


class CostCurve:
    """Seconds per call by a size (tokens, rows). Its shape: points measured at start-up
    (`calibrate`), or else learnt online (an average per size observed); linear
    interpolation between sizes, a least-squares line beyond them.

    Extrapolation errs towards trying a size; once tried, the size is measured, so a wrong
    guess corrects itself in one iteration (a pessimistic guess would never be tested).

    Start-up measures every size on short contexts at once. Serving's calls cost more, and
    by about the same at every size for a given number of rows: each row reads its whole
    cache once per call, however many tokens it verifies. So once calibrated, what serving
    observes moves the level, not the shape: per batch-size bucket, an average of the seconds
    per row a call costs beyond the start-up curve.
    """

    def __init__(self) -> None:
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
            self._add(size, seconds, EMA_WEIGHT)
            return
        rows = rows or size
        update_average(self.extra_per_row, batch_bucket(rows), (seconds - shape) / rows)

    def replace(self, size: int, seconds: float) -> None:
        """A measurement that starts the point's average afresh (its old one went stale)."""
        self._add(size, seconds, 1.0)

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

    def reaches_past(self, size: int) -> bool:
        """A point measured beyond `size`: estimates there interpolate, not extrapolate."""
        return bool(self.sizes) and self.sizes[-1] > size

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
    and luring the loop into speculating again on the strength of one lucky probe. A weak
    prior (PRIOR_WEIGHT pseudo-observations of COLD_PRIOR) keeps one sample from reading as
    certainty. A cold prior (`cold_weight` more pseudo-observations of COLD_PRIOR at the
    first position) is where a fresh window starts; unlike the weak prior it fades like an
    observation does, so it rules only until there is evidence. Only the first position has
    one: probes observe it without drafting, while a later position is observed only by
    drafting that far, which a cold prior there would stop for good.
    """

    def __init__(self, max_k: int, window: int = WINDOW, cold_weight: float = 0.0) -> None:
        self.decay = 1.0 - 1.0 / window
        self.cold = cold_weight  # what is left of the cold prior (first position)
        self.accepted = [0.0] * max_k
        self.tried = [0.0] * max_k

    @property
    def explored(self) -> bool:
        """Some verdict on the first position has come in."""
        return bool(self.tried) and self.tried[0] > 0

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
        per-position rates to shrink towards instead of COLD_PRIOR (a row's own window
        shrinks towards every row's). What is left of the cold prior counts at the first
        position, seen or not."""
        rates, last = [], COLD_PRIOR
        for i, (accepted, tried) in enumerate(zip(self.accepted, self.tried, strict=True)):
            position_prior = COLD_PRIOR if prior is None else prior[i]
            cold = self.cold if i == 0 else 0.0
            if tried > 0 or cold > 0:
                pseudo = position_prior * PRIOR_WEIGHT + COLD_PRIOR * cold
                last = (accepted + pseudo) / (tried + PRIOR_WEIGHT + cold)
            elif prior is not None:
                last = position_prior
            rates.append(last)
        return rates


# -- costs -----------------------------------------------------------------------------------


class HostCost:
    """The loop's own seconds in a steady iteration beyond its engine calls (planning,
    committing, responses, the glue between steps), by batch size: a level where every row
    verifies one token, and what each token verified beyond that adds (a ratio of running
    averages: one iteration's few extra tokens are a noisy sample of it).

    Both are measured as an iteration's seconds less its own engine calls' seconds, so they
    do not go stale while contexts grow: what grows with a context is the engine calls'
    cost, which the target's curve prices at its current level."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # by rows
        self.extra_seconds: dict[int, float] = {}  # beyond plain, averaged, by rows
        self.extra_tokens: dict[int, float] = {}  # beyond one per row, averaged, by rows

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        plain = self.plain.get(rows)
        if tokens <= rows:
            update_average(self.plain, rows, seconds)
        elif plain is not None:
            update_average(self.extra_seconds, rows, seconds - plain)
            update_average(self.extra_tokens, rows, float(tokens - rows))

    def estimate(self, rows: int, tokens: int) -> float:
        """Seconds; 0 where nothing was measured near this many rows."""
        plain = _nearest(self.plain, rows) or 0.0
        extra = tokens - rows
        if extra <= 0 or rows not in self.extra_tokens:
            return plain
        per_token = max(0.0, self.extra_seconds[rows] / self.extra_tokens[rows])
        return plain + per_token * extra


def _nearest(values: dict[int, float], key: int) -> float | None:
    """The value at `key`, or else at the nearest key measured (None: none is)."""
    if key in values:
        return values[key]
    if not values:
        return None
    return values[min(values, key=lambda k: (abs(k - key), k))]


@dataclass(frozen=True)
class StepShape:
    """A steady step (no prefill) as the cost model keys it."""

    batch_size: int
    num_tokens: int  # tokens the target verified
    num_widths: int  # distinct tokens-per-row in the verify (an attention call each)
    model_steps: int | None  # the draft model call's steps (0: a catch-up); None: no call


class Costs:
    """What steps cost: the engine calls, and whole steady iterations as they really cost
    (the loop's own work per token and per iteration included). Whole iterations are kept by
    batch size and draft steps, each a curve by tokens verified, with what their widths
    added taken out; calls and iterations are booked from outside the step
    (specdec/loop/timing.py)."""

    def __init__(self) -> None:
        self.target = CostCurve()  # the target call's seconds by tokens verified
        self.width = CostCurve()  # a verify's extra seconds per width of rows, by rows
        self.host = HostCost()  # the loop's own work in an iteration without a model call
        self.draft_step = CostCurve()  # the draft model's seconds per step, by rows
        self.iterations: dict[tuple[int, int | None], CostCurve] = {}
        self.iteration = 0  # steps ended so far
        self.last_seen: dict[tuple[int, int | None, int], int] = {}  # point -> iteration

    def calibrated(self, calibration: Calibration) -> None:
        for (rows, tokens), seconds in calibration.target.items():
            self.target.calibrate(rows * tokens, seconds)
        for rows, seconds in calibration.draft_step.items():
            self.draft_step.calibrate(rows, seconds)
        for rows, seconds in calibration.width_costs().items():
            self.width.calibrate(rows, seconds)

    def widths(self, batch_size: int, num_widths: int) -> float:
        """What a verify's widths beyond the first add."""
        return (self.width.estimate(batch_size) or 0.0) * max(0, num_widths - 1)

    def observe_iteration(self, shape: StepShape, seconds: float, engine_seconds: float) -> None:
        """A whole steady iteration, from its start to the next one's, and what its engine
        calls took of that."""
        if shape.model_steps is None:
            self.host.observe(shape.batch_size, shape.num_tokens, seconds - engine_seconds)
        key = (shape.batch_size, shape.model_steps)
        curve = self.iterations.setdefault(key, CostCurve())
        seconds -= self.widths(shape.batch_size, shape.num_widths)
        point = (*key, shape.num_tokens)
        seen = self.last_seen.get(point)
        if seen is not None and self.iteration - seen >= STALE_AFTER:
            curve.replace(shape.num_tokens, seconds)
        else:
            curve.observe(shape.num_tokens, seconds)
        self.last_seen[point] = self.iteration

    def measured(self, shape: StepShape) -> float | None:
        """Seconds of a whole iteration of this shape, if measured lately."""
        point = (shape.batch_size, shape.model_steps, shape.num_tokens)
        seen = self.last_seen.get(point)
        if seen is None or self.iteration - seen >= STALE_AFTER:
            return None
        seconds = self.iterations[point[:2]].seconds[shape.num_tokens]
        return seconds + self.widths(shape.batch_size, shape.num_widths)

    def verify_cost(self, batch_size: int) -> Callable[[int], float | None]:
        """Seconds of an iteration without a model call, by tokens verified (widths apart):
        the target call as its start-up shape and its current level price it, plus the
        loop's own work (`HostCost`).

        Whole iterations as measured would price it alone only if they were measured at the
        same moment: a point of many tokens is reached rarely, and its average was taken
        when the contexts, and so every call, were shorter, while plain decoding's point
        moves every iteration. Compared so, extra tokens looked almost free: at 16 chat
        streams, bfloat16, a lookup's 9.6 tokens were priced at 1.04x plain decoding's
        iteration and cost 1.33x (docs/benchmarks.md, "What a lookup costs at 16 rows and
        more")."""
        if self.target.calibrated:
            target, host = self.target.estimate, self.host.estimate

            def cost(num_tokens: int) -> float | None:
                seconds = target(num_tokens, batch_size)
                return None if seconds is None else seconds + host(batch_size, num_tokens)

            return cost
        return self._measured_verify_cost(batch_size)

    def _measured_verify_cost(self, batch_size: int) -> Callable[[int], float | None]:
        """Before start-up has measured the target (no calibration): whole iterations of
        this batch size where they reach past plain decoding, or else the target call's
        online curve where that does. Without either, extra tokens are priced at nothing,
        so that one verify is tried and measured (extrapolating from plain decoding alone
        would price each token as a whole row, and speculation would never start)."""
        measured = self.iterations.get((batch_size, None))
        for curve in (measured, self.target):
            if curve is not None and curve.reaches_past(batch_size):
                return partial(curve.estimate, rows=batch_size)
        plain = (measured or self.target).estimate(batch_size, batch_size)
        return lambda num_tokens: plain


# -- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OtherRow:
    """A row of the batch outside a model planner's choice: its draft tokens this step, and
    whether the model proposer drafts for it (its request fixed k) or not (a lookup or no
    proposer: what it emits does not depend on the choice, so it counts as one token)."""

    k: int
    model: bool


@dataclass
class Choice:
    """A model proposer's plan for its adaptive rows."""

    k: int  # for every adaptive row
    # Refresh alpha_1 this iteration while the rows decode plainly; the proposer picks how
    # (a greedy row's draft catches up and guesses the tokens it missed, or one row
    # proposes a token).
    probe: bool = False


class ModelPlanner:
    """One k for all the adaptive rows of a model proposer: its call runs the longest row's
    steps for every row, so a row drafting fewer tokens saves verify time but no draft time.

    k > 0 is chosen where it promises more goodput than k = 0 by SPECULATION_MARGIN, both
    priced by whole iterations as measured (they include the glue's work between steps), or
    else by EXPLORE_MARGIN, both priced by the per-call models and corrected by how far off
    those were when both were last measured at this batch size (a model against a
    measurement would favour whichever k has not been measured). Among the k that clear it,
    a larger k must beat a smaller one by LONGER_K_MARGIN.
    """

    def __init__(self, max_k: int, costs: Costs, verdicts_per_probe: int) -> None:
        self.max_k = max_k
        self.costs = costs
        self.acceptance = AcceptanceWindow(max_k, cold_weight=COLD_PROBES * verdicts_per_probe)
        # Measured over modelled cost, by (batch-size bucket, k), kept after the measurement
        # goes stale: once a k proved dearer than its model, a guess at it is corrected.
        self.model_error: dict[tuple[int, int], float] = {}
        self.iterations_without_draft = 0

    def choose(self, num_adaptive: int, others: list[OtherRow]) -> Choice:
        """k for the adaptive rows, given the batch's other rows."""
        if num_adaptive == 0:
            return Choice(0)
        if not self.acceptance.explored:  # nothing known: probe at once, do not draft
            return Choice(0, probe=True)
        rates = self.acceptance.rates()
        plain_tokens = self._tokens(0, num_adaptive, others, rates)
        plain_modelled = self._modelled_cost(0, num_adaptive, others)
        if plain_modelled is None:  # the target's cost is not known yet
            return Choice(0)
        plain_measured = self.costs.measured(self._shape(0, num_adaptive, others))
        best, best_gain = Choice(0), 1.0
        bucket = batch_bucket(num_adaptive + len(others))
        for k in range(1, self.max_k + 1):
            measured = self.costs.measured(self._shape(k, num_adaptive, others))
            cost: float
            if measured is not None and plain_measured is not None:
                cost, plain_cost, margin = measured, plain_measured, SPECULATION_MARGIN
            else:
                modelled = self._modelled_cost(k, num_adaptive, others)
                if modelled is None:  # the draft's cost never measured: try it once
                    return Choice(k)
                cost, plain_cost, margin = modelled, plain_modelled, EXPLORE_MARGIN
                error = self.model_error.get((bucket, k))
                plain_error = self.model_error.get((bucket, 0))
                if error is not None and plain_error is not None:  # both or neither
                    cost, plain_cost = cost * error, plain_cost * plain_error
            goodput = self._tokens(k, num_adaptive, others, rates) / cost
            gain = goodput / (plain_tokens / plain_cost)
            if gain > margin and gain > best_gain * LONGER_K_MARGIN:
                best, best_gain = Choice(k), gain
        if best.k == 0 and self.iterations_without_draft >= self._probe_interval(
            num_adaptive + len(others), plain_measured
        ):
            best.probe = True
        return best

    def observe_iteration(self, shape: StepShape, seconds: float) -> None:
        """A whole iteration: where every row verified as many tokens, with or without this
        model's call as that k needs, how far off the per-call models were."""
        if shape.num_widths != 1 or shape.num_tokens % shape.batch_size:
            return
        k = shape.num_tokens // shape.batch_size - 1
        if shape.model_steps != (k or None):  # a catch-up call, or another proposer's tokens
            return
        modelled = self._modelled_cost(k, shape.batch_size, [])
        if modelled:
            update_average(
                self.model_error, (batch_bucket(shape.batch_size), k), seconds / modelled
            )

    def end_step(self, drafted: bool) -> None:
        """`drafted`: the model was called this step (a catch-up too)."""
        self.iterations_without_draft = 0 if drafted else self.iterations_without_draft + 1

    def _probe_interval(self, batch_size: int, plain: float | None) -> int:
        """A probe's iteration as measured: a greedy row's catch-up, or else one row
        proposing one token."""
        catch_up = StepShape(batch_size, batch_size, 1, 0)
        one_token = StepShape(batch_size, batch_size + 1, min(2, batch_size), 1)
        probe = self.costs.measured(catch_up) or self.costs.measured(one_token)
        return probe_interval(plain, probe)

    @staticmethod
    def _shape(k: int, num_adaptive: int, others: list[OtherRow]) -> StepShape:
        row_ks = [k] * num_adaptive + [o.k for o in others]
        model_ks = ([k] * num_adaptive if k else []) + [o.k for o in others if o.model]
        return StepShape(
            batch_size=len(row_ks),
            num_tokens=sum(row_ks) + len(row_ks),
            num_widths=len(set(row_ks)),
            model_steps=max(model_ks) if model_ks else None,
        )

    @staticmethod
    def _tokens(k: int, num_adaptive: int, others: list[OtherRow], rates: list[float]) -> float:
        """Expected tokens the batch emits in one pass with the adaptive rows at k."""
        tokens = num_adaptive * expected_tokens(rates, k)
        return tokens + sum(expected_tokens(rates, o.k) if o.model else 1.0 for o in others)

    def _modelled_cost(self, k: int, num_adaptive: int, others: list[OtherRow]) -> float | None:
        """Seconds of the draft and target calls of one pass, from the per-call curves."""
        verified = num_adaptive * (k + 1) + sum(o.k + 1 for o in others)
        target = self.costs.target.estimate(verified, num_adaptive + len(others))
        if target is None:
            return None
        model_ks = ([k] * num_adaptive if k else []) + [o.k for o in others if o.model and o.k]
        if not model_ks:
            return target
        step = self.costs.draft_step.estimate(len(model_ks))
        if step is None:
            return None
        return target + step * max(model_ks)


def plan_tokens_by_gain(
    offers: list[tuple[int, int, list[float]]],  # (row, max tokens, rates by position)
    batch_size: int,
    verify_cost: Callable[[int], float | None],  # seconds of a verify of this many tokens
    width_cost: float = 0.0,
    margin: float = SPECULATION_MARGIN,
) -> dict[int, int]:
    """Draft tokens per row (row -> k, only rows with k > 0).

    Tokens are taken in order of their expected gain (row r's j-th proposal adds
    prod_{i<=j} rates_r[i] expected tokens), and the plan stops at the prefix of that order
    with the best goodput, (batch_size + gains) / cost, where cost is verify_cost(batch_size
    + tokens) plus `width_cost` for each width of rows beyond the single-token one (the
    engine runs an attention call per width). It is used only if that beats plain decoding's
    batch_size / verify_cost(batch_size) by `margin`."""
    gains = []
    for row, max_tokens, rates in offers:
        survive = 1.0
        for j in range(max_tokens):
            survive *= rates[min(j, len(rates) - 1)]
            gains.append((survive, -j, row))
    plain_cost = verify_cost(batch_size)
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
        cost = verify_cost(batch_size + count)
        if cost:
            cost += width_cost * (len(widths) - 1)
            if expected / cost > best_goodput:
                best_goodput, best_count = expected / cost, count
    plan: dict[int, int] = {}
    for _, _, row in gains[:best_count]:
        plan[row] = plan.get(row, 0) + 1
    return plan


@dataclass
class RowLedger:
    """A row's own acceptance under a lookup proposer, and how long its offers went unused."""

    key: int | None = None  # the acceptance key of its latest offer
    acceptance: AcceptanceWindow | None = None  # once a proposal of it was verified
    idle: int = 0  # steps with an offer that was not verified


@dataclass
class RowOffer:
    """What a proposer can propose for one candidate row this step."""

    row: int  # index among the candidates
    max_tokens: int  # draft tokens available (capped by the row's k)
    key: int | None  # the acceptance window it counts under (prompt lookup: match length)


class LookupPlanner:
    """Tokens row by row for a proposer without a model call: each row's own acceptance
    (shrunk towards every row's of the same key) against the cost of a whole iteration of
    this batch size by tokens verified (`plan_tokens_by_gain`).

    A row whose offer went unused for probe_interval() x batch_size steps probes its whole
    offer, so that every position's acceptance is learnt, not only the first's (with
    one-token probes where a short verify is dear, a longer one was never tried); scaled by
    the batch, so that the batch probes about once per interval steps whatever its size: a
    probe makes the verify's rows unequal in length, which costs a width. The first row with
    a key no verdict has reached probes at once, so a fresh server learns what its proposals
    are worth from evidence, not from the cold prior, which where a verify is dear never
    pays for a try."""

    def __init__(self, max_k: int, costs: Costs, verdicts_per_probe: int) -> None:
        self.max_k = max_k
        self.costs = costs
        self.cold_weight = COLD_PROBES * verdicts_per_probe
        self.acceptance: dict[int | None, AcceptanceWindow] = {}  # every row's, by key
        self.rows: dict[int, RowLedger] = {}  # by sequence id

    def window(self, key: int | None) -> AcceptanceWindow:
        """Every row's acceptance under this key."""
        window = self.acceptance.get(key)
        if window is None:
            window = AcceptanceWindow(self.max_k, cold_weight=self.cold_weight)
            self.acceptance[key] = window
        return window

    def offered(self, sequence_id: int, key: int | None) -> RowLedger:
        """Notes the key of a row's offer this step (its verdict counts under it)."""
        ledger = self.rows.setdefault(sequence_id, RowLedger())
        ledger.key = key
        return ledger

    def plan(
        self, offers: list[RowOffer], sequence_ids: list[int], batch_size: int
    ) -> dict[int, int]:
        """Candidate index -> k, for the offers (max_tokens > 0) that pay or probe;
        `sequence_ids`: each candidate's sequence."""
        ledgers = [self.offered(sequence_ids[o.row], o.key) for o in offers]
        options = [
            (offer.row, offer.max_tokens, self._rates(ledger, offer.key))
            for offer, ledger in zip(offers, ledgers, strict=True)
        ]
        plan = plan_tokens_by_gain(
            options,
            batch_size,
            self.costs.verify_cost(batch_size),
            self.costs.width.estimate(batch_size) or 0.0,
        )
        ks = {}
        every = self.probe_interval(batch_size)
        probed: set[int | None] = set()  # keys probed this step
        for offer, ledger in zip(offers, ledgers, strict=True):
            k = plan.get(offer.row, 0)
            if k == 0:
                ledger.idle += 1
                first = offer.key not in probed and not self.window(offer.key).explored
                if ledger.idle < every * batch_size and not first:
                    continue
                probed.add(offer.key)
                k = offer.max_tokens  # a probe: the whole offer
            ledger.idle = 0
            ks[offer.row] = k
        return ks

    def worth(self, sequence_id: int, key: int | None, num_tokens: int) -> float:
        """Expected tokens a row's offer adds to the verify's; infinite while no verdict has
        reached its key (so that the key is explored, not judged by the cold prior)."""
        if not self.window(key).explored:
            return math.inf
        ledger = self.rows.get(sequence_id, RowLedger())
        return expected_tokens(self._rates(ledger, key), num_tokens) - 1.0

    def _rates(self, ledger: RowLedger, key: int | None) -> list[float]:
        """A row's acceptance by position: its own, shrunk towards every row's of the key."""
        shared = self.window(key).rates()
        return ledger.acceptance.rates(shared) if ledger.acceptance else shared

    def probe_interval(self, batch_size: int) -> int:
        """A probe's verify (a whole offer of max_k tokens, one more width) against a plain
        one, by the target call's curve."""
        plain = self.costs.target.estimate(batch_size, batch_size)
        probe = self.costs.target.estimate(batch_size + self.max_k, batch_size)
        if probe is not None:
            probe += self.costs.widths(batch_size, 2)
        return probe_interval(plain, probe)

    def observe(self, sequence_id: int, k: int, num_accepted: int) -> None:
        ledger = self.rows[sequence_id]
        if ledger.acceptance is None:
            ledger.acceptance = AcceptanceWindow(self.max_k, window=ROW_WINDOW)
        ledger.acceptance.observe(k, num_accepted)
        self.window(ledger.key).observe(k, num_accepted)

    def release(self, sequence_id: int) -> None:
        self.rows.pop(sequence_id, None)


# -- the cost model of one loop --------------------------------------------------------------


class ProposerKind(Protocol):
    """What the cost model needs to know of a proposer (specdec/loop/proposers/base.py)."""

    name: ClassVar[str]
    calls_model: ClassVar[bool]  # its proposals cost a model call for all its rows
    verdicts_per_probe: ClassVar[int]  # first-position verdicts one probe of it brings


class Economics:
    """One loop's costs, and a planner per proposer by how its proposals cost: one k for a
    model proposer's rows, tokens row by row for the others. Fed from outside the step: the
    engine calls (specdec/loop/timing.py, MeteredEngines), whole iterations (StepTimer), and
    the verdicts the step commits."""

    def __init__(self, max_k: int, proposers: Iterable[ProposerKind]) -> None:
        self.costs = Costs()
        self.model_planners: dict[str, ModelPlanner] = {}
        self.lookup_planners: dict[str, LookupPlanner] = {}
        for proposer in proposers:
            if proposer.calls_model:
                planner = ModelPlanner(max_k, self.costs, proposer.verdicts_per_probe)
                self.model_planners[proposer.name] = planner
            else:
                lookup = LookupPlanner(max_k, self.costs, proposer.verdicts_per_probe)
                self.lookup_planners[proposer.name] = lookup

    def calibrated(self, calibration: Calibration) -> None:
        """The engines' costs as start-up measured them (specdec/loop/calibration.py)."""
        self.costs.calibrated(calibration)

    def observe_calls(self, calls: Iterable[EngineCall], steady: bool) -> None:
        """A step's engine calls. The target's books only in a steady step (a prefill is not
        what a verify costs); a draft call's steps only after 1 or 2 fed tokens (a catch-up
        would blur the cost of a step)."""
        for call in calls:
            if call.kind == "target" and steady:
                # Net of its widths, which are priced apart: a ragged verify's own calls
                # would otherwise raise the level of every verify.
                seconds = call.seconds - self.costs.widths(call.num_rows, call.num_widths)
                self.costs.target.observe(call.num_tokens, seconds, call.num_rows)
            elif call.kind == "draft" and call.max_fed <= 2 and call.num_steps > 0:
                self.costs.draft_step.observe(call.num_rows, call.seconds / call.num_steps)

    def observe_iteration(self, shape: StepShape, seconds: float, engine_seconds: float) -> None:
        """A whole steady iteration, from its start to the next one's, and its engine
        calls' share of that (StepTimer)."""
        self.costs.observe_iteration(shape, seconds, engine_seconds)
        for planner in self.model_planners.values():
            planner.observe_iteration(shape, seconds)

    def observe_verdict(self, proposer: str, sequence_id: int, k: int, num_accepted: int) -> None:
        """Of a row's k draft tokens, the first num_accepted were accepted."""
        if proposer in self.model_planners:
            self.model_planners[proposer].acceptance.observe(k, num_accepted)
        else:
            self.lookup_planners[proposer].observe(sequence_id, k, num_accepted)

    def observe_hindsight(self, proposer: str, hits: int, total: int) -> None:
        """First-position verdicts a model proposer saw without a verify (a draft's guesses
        of tokens that plain decoding produced)."""
        self.model_planners[proposer].acceptance.observe_first(hits, total)

    def end_step(self, called: Iterable[str]) -> None:
        """A step is over; `called`: the proposers called in it."""
        self.costs.iteration += 1
        called = set(called)
        for name, planner in self.model_planners.items():
            planner.end_step(drafted=name in called)

    def release(self, sequence_id: int) -> None:
        for planner in self.lookup_planners.values():
            planner.release(sequence_id)
