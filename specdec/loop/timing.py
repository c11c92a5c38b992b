"""What the loop measures, from outside its step: every engine call (`MeteredEngines`) and
every steady step's whole cost (`StepTimer`), handed to the cost model
(specdec/loop/economics.py).

A step's whole cost runs from its start to the next step's start, so that the glue's work
between steps (responses, cancellation checks) counts too: a proposal that saves a target
pass but costs the loop as much in its own work is no gain. A step after which the loop
waited for work is not booked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.engines.wire import EngineBatch, EngineResult, Engines

if TYPE_CHECKING:
    from specdec.loop.economics import Economics, StepShape
    from specdec.loop.scheduler import SpeculativeScheduler, StepResult

# A step whose next one started this many times its own length later: the loop idled.
IDLE_GAP = 3.0


@dataclass(frozen=True)
class EngineCall:
    """One engine call as it was made."""

    kind: str  # "draft" or "target"
    num_rows: int
    num_tokens: int  # tokens fed, all rows
    max_fed: int  # the most tokens one row was fed
    num_steps: int  # the most steps one row asked for (draft: proposals; target: positions)
    seconds: float
    result_bytes: int
    num_widths: int = 1  # distinct tokens fed per row (the engine runs an attention call each)


class MeteredEngines:
    """The loop's engines, recording each call (`take` hands them over once per step)."""

    def __init__(self, engines: Engines, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engines = engines
        self.clock = clock
        self.calls: list[EngineCall] = []
        # Guided rows' grammars, where the engines have them (specdec/engines/grammar.py).
        self.grammars = getattr(engines, "grammars", None)

    def draft(self, batch: EngineBatch) -> EngineResult:
        return self._call("draft", self.engines.draft, batch)

    def target(self, batch: EngineBatch) -> EngineResult:
        return self._call("target", self.engines.target, batch)

    def _call(self, kind: str, call, batch: EngineBatch) -> EngineResult:
        start = self.clock()
        result = call(batch)
        self.calls.append(
            EngineCall(
                kind=kind,
                num_rows=len(batch.slot_ids),
                num_tokens=len(batch.input_ids),
                max_fed=int(batch.input_lengths.max(initial=0)),
                num_steps=int(batch.num_steps.max(initial=0)),
                num_widths=len(set(batch.input_lengths.tolist())),
                seconds=self.clock() - start,
                result_bytes=result.nbytes,
            )
        )
        return result

    def take(self) -> list[EngineCall]:
        """The calls since the last take."""
        calls, self.calls = self.calls, []
        return calls


@dataclass
class _Running:
    shape: StepShape
    start: float
    busy: float  # seconds inside step()
    engine_seconds: float  # of its engine calls


class StepTimer:
    """Runs a scheduler's steps and books each steady one's whole cost into its cost model
    when the next step starts."""

    def __init__(
        self, scheduler: SpeculativeScheduler, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.scheduler = scheduler
        self.economics: Economics = scheduler.economics
        self.clock = clock
        self._last: _Running | None = None

    def step(self) -> StepResult:
        """One step of the scheduler, timed."""
        start = self.clock()
        last, self._last = self._last, None
        if last is not None and start - last.start < IDLE_GAP * last.busy:
            self.economics.observe_iteration(last.shape, start - last.start, last.engine_seconds)
        result = self.scheduler.step()
        if result.shape is not None and result.stats is not None and self.scheduler.has_work:
            engines = result.stats.target_seconds + result.stats.draft_seconds
            self._last = _Running(result.shape, start, self.clock() - start, engines)
        return result
