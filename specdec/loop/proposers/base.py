"""The proposer interface: where a row's draft tokens come from.

Each step, the policy (specdec/loop/policy.py) offers a proposer the rows it may serve, and
the proposer says how many tokens each of them gets (`plan`; `plan_exact` for a row whose
request fixed k). It then proposes for all its rows at once (`propose`), and sees each row's
verdict (`observe`): of the k draft tokens, the first `num_accepted` were accepted; the
emitted token after them is a recovered token (a rejection) or, when all k were accepted,
the bonus token. A proposer keeps its own per-row state, keyed by the sequence's id, and
drops it in `release`.

A new proposer is one module in this package and one line in its registry (`__init__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.calibration import Calibration
    from specdec.loop.config import SchedulerConfig
    from specdec.loop.controller import CostCurve


@dataclass
class Proposal:
    token_ids: list[int]  # (k,) draft tokens (a model's sampled rows: drawn with the
    # target's noise, specdec/engines/coupling.py)


@dataclass
class Candidate:
    """A row a proposer may serve this step."""

    sequence: SequenceState
    max_k: int  # its most draft tokens this step (request, server, max_tokens, context)


@dataclass
class TimedStep:
    """A steady step (no prefill): its whole cost is measured from its start to the next
    step's start, so that the glue's work between steps (responses, cancellation checks)
    counts too."""

    start: float
    busy: float  # seconds inside step(); a much longer gap means the loop idled after it
    batch_size: int
    num_tokens: int  # tokens the target verified
    num_widths: int  # distinct tokens-per-row in the verify (an attention call each)
    model_drafted: bool  # a proposer called a model


class Proposer(ABC):
    name: ClassVar[str]  # what requests and the `proposers` parameter call it
    calls_model: ClassVar[bool]  # proposing costs a model call (and owns the draft cache)

    def __init__(self, config: SchedulerConfig, engines: Engines, target_cost: CostCurve) -> None:
        """`target_cost`: the target call's seconds by tokens verified, measured by the loop."""
        self.chosen_k = 0  # one k chosen for all its adaptive rows this step, if it has one

    @abstractmethod
    def plan_exact(self, candidate: Candidate) -> int:
        """Draft tokens for a row whose request fixed k at candidate.max_k (0: none)."""

    @abstractmethod
    def plan(
        self, candidates: list[Candidate], batch_size: int, fixed_ks: list[int]
    ) -> dict[int, int]:
        """Candidate index -> k, for the rows it serves this step. A model proposer may also
        take a row with k = 0: its draft catches up without proposing. `fixed_ks`: the k of
        the batch's rows outside any proposer's choice."""

    @abstractmethod
    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        """One proposal per row. `copies`: prompt caches a model proposer copies into its
        cache before the call (specdec/loop/admission.py)."""

    @abstractmethod
    def observe(self, sequence: SequenceState, k: int, num_accepted: int) -> None:
        """The verdict on the row's k draft tokens: the first num_accepted were accepted."""

    def calibrated(self, calibration: Calibration) -> None:  # noqa: B027
        """The engines' costs as measured at start-up (specdec/loop/calibration.py)."""

    def observe_iteration(self, step: TimedStep, seconds: float) -> None:  # noqa: B027
        """The whole cost of the last step it planned, called before its next plan."""

    def end_step(self) -> None:  # noqa: B027
        """Called once a step's verdicts are in."""

    def release(self, sequence: SequenceState) -> None:  # noqa: B027
        """The sequence ended: drop its per-row state."""
