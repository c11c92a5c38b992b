"""Start-up cost measurement: what the engines cost at the batch sizes and k the loop will
use, measured before the first request is served.

On a fresh server the cost curves that every proposer's tokens are priced by
(specdec/loop/economics.py) are empty. The draft model's k is then tried at 1 once on the
whole batch to learn what a draft step costs (at 16 rows: 16 draft catch-ups of whole
prompts), and prompt lookup's extra verify tokens are priced at nothing until a longer
verify has been measured. Both are bets that the first burst of requests pays for. With the
curves filled here, the first choices are priced from measurements; only acceptance is
unknown, and the cost model learns it from probes.

`calibrate` runs on free slots, before the loop serves. For each batch size of the plan,
smallest first, it gives the slots it has not used yet a short context (CONTEXT_TOKENS, one
prefill), then times
- the draft: one call of max_k steps after one fed token (per step);
- the target at each tokens per row of the plan: a verify of tokens - 1 proposals, as the
  curve keys it (tokens verified in all);
- a ragged verify (batch sizes of 2 rows or more): every row one token but one of max_k + 1.
  The engine runs one attention call per width of rows, so a second width costs more than
  its tokens (docs/benchmarks-archive.md, "2026-12-05: the cost curves' level, and widths in
  a verify"); a lookup proposer's rows propose different numbers of tokens, and the cost
  model prices that (specdec/loop/economics.py). It comes with its batch size, not after
  all the others: put last, a 5-s budget on 2 cores would never reach it.
Each shape gets one untimed call first (a shape's first call pays allocations), and the plan
stops once `budget_s` is spent, so that a slow host measures the small batches and a GPU
all of them: what is not measured is extrapolated by the curves, as before. The slots'
contents are left behind past length 0; a new sequence starts from cache length 0 and
overwrites them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec.engines.wire import EngineBatch, Engines
from specdec.loop.economics import CostCurve

CONTEXT_TOKENS = 8  # positions each calibration row has before the timed calls
ROWS_CAP = 64  # beyond this many rows the curves extrapolate (linear in tokens)
# A filler token: any id the vocabulary has; the cost does not depend on which.
FILLER_TOKEN = 100


@dataclass(frozen=True)
class CalibrationPlan:
    rows: tuple[int, ...]  # batch sizes, ascending
    tokens_per_row: tuple[int, ...]  # target positions per row: plain decoding, one
    # proposal, max_k proposals
    draft_steps: int  # the draft call's steps (max_k)
    budget_s: float

    @classmethod
    def for_server(cls, num_slots: int, max_k: int, budget_s: float) -> CalibrationPlan:
        """Powers of two up to the slots (at most ROWS_CAP) and the slots themselves; 1, 2
        and max_k + 1 tokens per row."""
        top = min(num_slots, ROWS_CAP)
        rows = {top}
        r = 1
        while r < top:
            rows.add(r)
            r *= 2
        tokens = {1, 2, max_k + 1} if max_k > 0 else {1}
        return cls(tuple(sorted(rows)), tuple(sorted(tokens)), max_k, budget_s)


@dataclass
class Calibration:
    """What start-up measured: seconds per call."""

    target: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, tokens/row)
    draft_step: dict[int, float] = field(default_factory=dict)  # rows -> seconds per step
    # rows -> (width, seconds): rows - 1 single-token rows and one row of `width` tokens
    ragged: dict[int, tuple[int, float]] = field(default_factory=dict)
    seconds: float = 0.0  # all of it, prefill included
    skipped: int = 0  # shapes the budget left out

    def summary(self) -> str:
        """One line for the server log."""
        target = ", ".join(f"{r}x{t}: {s * 1e3:.1f}" for (r, t), s in sorted(self.target.items()))
        draft = ", ".join(f"{r}: {s * 1e3:.1f}" for r, s in sorted(self.draft_step.items()))
        draft = draft or "none measured"
        widths = ", ".join(f"{r}: {s * 1e3:.1f}" for r, s in sorted(self.width_costs().items()))
        skipped = f"; {self.skipped} shapes over the budget skipped" if self.skipped else ""
        return (
            f"start-up costs in {self.seconds:.1f} s: target call ms by rows x tokens per row "
            f"[{target}]; draft step ms by rows [{draft}]; a second width in a verify ms by "
            f"rows [{widths or 'none measured'}]{skipped}"
        )

    def width_costs(self) -> dict[int, float]:
        """By rows: what a verify pays for one more width of rows, beyond its tokens (the
        engine runs an attention call per width): the ragged verify against a uniform one
        of as many tokens over as many rows, interpolated between the rows' own timings."""
        costs = {}
        for rows, (width, seconds) in self.ragged.items():
            uniform = CostCurve()  # by tokens, over this many rows only
            for (r, tokens_per_row), s in self.target.items():
                if r == rows:
                    uniform.calibrate(rows * tokens_per_row, s)
            estimate = uniform.estimate(rows - 1 + width)
            if estimate is not None:
                costs[rows] = max(0.0, seconds - estimate)
        return costs


def calibration_batch(
    rows: int, input_lengths: int, cache_length: int, num_steps: int, first_slot: int = 0
) -> EngineBatch:
    """Greedy rows on slots first_slot.., each fed `input_lengths` filler tokens after
    `cache_length` cached positions."""

    def column(value, dtype):
        return np.full(rows, value, dtype=dtype)

    return EngineBatch(
        input_ids=np.full(rows * input_lengths, FILLER_TOKEN, dtype=np.int64),
        input_lengths=column(input_lengths, np.int32),
        slot_ids=np.arange(first_slot, first_slot + rows, dtype=np.int32),
        cache_lengths=column(cache_length, np.int32),
        num_steps=column(num_steps, np.int32),
        temperature=column(0.0, np.float32),
        top_k=column(0, np.int32),
        top_p=column(1.0, np.float32),
        end_ids=column(-1, np.int32),
        min_tokens_left=column(0, np.int32),
        seeds=np.arange(rows, dtype=np.int64),
    )


def ragged_batch(rows: int, width: int) -> EngineBatch:
    """Calibration rows of one token each but the last, of `width` tokens: a verify in
    which one row has proposals (the engine runs one attention call per width)."""
    batch = calibration_batch(rows, 1, CONTEXT_TOKENS, 1)
    batch.input_lengths[-1] = batch.num_steps[-1] = width
    batch.input_ids = np.full(rows - 1 + width, FILLER_TOKEN, dtype=np.int64)
    return batch


def calibrate(
    engines: Engines,
    plan: CalibrationPlan,
    with_draft: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> Calibration:
    """Times the engines as `plan` says (the module's docstring). `with_draft`: the server
    runs the draft model."""
    result = Calibration()
    started = clock()
    with_draft = with_draft and plan.draft_steps > 0
    # (rows, kind, tokens per row); kind 0: the draft, 1: the target, 2: a ragged verify
    shapes = [(rows, 0, 0) for rows in plan.rows if with_draft]
    shapes += [(rows, 1, tokens) for rows in plan.rows for tokens in plan.tokens_per_row]
    if plan.draft_steps > 0:
        shapes += [(rows, 2, plan.draft_steps + 1) for rows in plan.rows if rows > 1]
    shapes.sort()  # by rows: the draft, the target, then the ragged verify
    prefilled = 0  # slots below this hold CONTEXT_TOKENS positions in both engines

    def timed(call, batch: EngineBatch) -> float:
        call(batch)  # untimed: the shape's first call
        start = clock()
        call(batch)
        return clock() - start

    for i, (rows, kind, tokens) in enumerate(shapes):
        if clock() - started > plan.budget_s:
            result.skipped = len(shapes) - i
            break
        if rows > prefilled:
            context = calibration_batch(rows - prefilled, CONTEXT_TOKENS, 0, 1, prefilled)
            engines.target(context)
            if with_draft:
                context.num_steps[:] = 0  # the draft only caches the context
                engines.draft(context)
            prefilled = rows
        if kind == 0:
            batch = calibration_batch(rows, 1, CONTEXT_TOKENS, plan.draft_steps)
            result.draft_step[rows] = timed(engines.draft, batch) / plan.draft_steps
        elif kind == 1:
            batch = calibration_batch(rows, tokens, CONTEXT_TOKENS, tokens)
            result.target[(rows, tokens)] = timed(engines.target, batch)
        else:
            result.ragged[rows] = (tokens, timed(engines.target, ragged_batch(rows, tokens)))
    result.seconds = clock() - started
    return result
