"""The proposer interface: where a row's draft tokens come from.

A proposer says only how it proposes and what it observes; what its tokens cost and are
worth, and how many each row gets, is the cost model's (specdec/loop/economics.py). It
declares:
- `calls_model`: whether proposing costs a model call for all its rows at once (the cost
  model then gives its adaptive rows one k) or only the tokens it adds to the verify (the
  cost model takes them row by row);
- `verdicts_per_probe`: how many first-position verdicts one probe of it brings (a draft's
  catch-up guesses many tokens in hindsight, a lookup's verify judges one first token),
  which is what a fresh server's cold prior is weighed against;
and implements:
- `offer`: how many tokens it can propose for a row now, and the acceptance key they count
  under (prompt lookup: the match length; one key for all a model's rows);
- `probe`: how a model proposer refreshes its acceptance while its rows decode plainly;
- `propose`: one proposal for each of its rows, all at once. A proposal may carry
  first-position verdicts the proposer saw without a verify (a draft's hindsight guesses);
- `committed`: the step's rows took their tokens (a proposer that learns across requests
  reads them);
- `release`: the sequence ended, drop its per-row state.

Each step the policy (specdec/loop/policy.py) offers the proposers the rows they may serve,
and the step (specdec/loop/scheduler.py) tells the cost model each row's verdict: of the k
draft tokens, the first `num_accepted` were accepted; the emitted token after them is a
recovered token (a rejection) or, when all k were accepted, the bonus token.

A new proposer is one module in this package and one line in its registry (`__init__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from specdec.loop.sequence import CacheCopy, SequenceState

if TYPE_CHECKING:
    from specdec.engines.wire import Engines
    from specdec.loop.config import SchedulerConfig


@dataclass
class Proposal:
    token_ids: list[int]  # (k,) draft tokens (a model's sampled rows: drawn with the
    # target's noise, specdec/engines/coupling.py)
    # First-position verdicts seen while proposing, without a verify: (right, judged).
    hindsight: tuple[int, int] = (0, 0)


@dataclass
class Candidate:
    """A row a proposer may serve this step."""

    sequence: SequenceState
    max_k: int  # its most draft tokens this step (request, server, max_tokens, context)


@dataclass(frozen=True)
class Offer:
    """What a proposer can propose for a row this step."""

    num_tokens: int  # draft tokens available now, at most the candidate's max_k
    key: int | None = None  # the acceptance window its verdict counts under


class Proposer(ABC):
    name: ClassVar[str]  # what requests and the `proposers` parameter call it
    calls_model: ClassVar[bool]  # proposing costs a model call for all its rows
    verdicts_per_probe: ClassVar[int]  # first-position verdicts one probe brings

    def __init__(self, config: SchedulerConfig, engines: Engines) -> None:  # noqa: B027
        """`engines`: the loop's engine calls (a model proposer calls the draft)."""

    @abstractmethod
    def offer(self, candidate: Candidate) -> Offer:
        """How many tokens it can propose for the row now (0: none), and under which key."""

    def probe(self, candidates: list[Candidate]) -> tuple[int, int] | None:
        """A model proposer's probe while its rows decode plainly: (candidate index, k),
        or None where it has none."""
        return None

    @abstractmethod
    def propose(
        self, rows: list[SequenceState], ks: list[int], copies: list[CacheCopy]
    ) -> list[Proposal]:
        """One proposal per row, of ks[i] tokens (a model proposer may be called for a row
        with k = 0: its draft catches up). `copies`: prompt caches a model proposer copies
        into its cache before the call (specdec/loop/admission.py)."""

    def committed(self, batch: list[SequenceState]) -> None:  # noqa: B027
        """The step committed these rows' tokens (every row of the batch, whoever proposed
        for it): a proposer that learns from all text reads it here."""

    def release(self, sequence: SequenceState) -> None:  # noqa: B027
        """The sequence ended: drop its per-row state."""
