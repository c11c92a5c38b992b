"""The speculate-verify loop with in-flight batching (arXiv 2211.17192, 2302.01318).

One `step()` serves every running sequence, in three parts:
1. plan: waiting sequences take free KV slots (specdec/loop/admission.py); long prompts are
   split into chunks; each row gets its proposer and k (specdec/loop/policy.py), and the
   cache copies the calls make are planned. The plan is a value (`StepPlan`, `StepWork`):
   no engine has run yet.
2. execute: each proposer proposes for all its rows at once (the draft model is called only
   when some row drafts with it, or catches up to probe); one target call checks every row's
   proposals.
3. commit: each row accepts its own prefix, plus a recovered or bonus token; a rejected
   draft token is rolled back by a shorter cache length. The verdicts go to the cost model
   (specdec/loop/economics.py).
Timing observes from outside (specdec/loop/timing.py): the engine calls are metered, and a
StepTimer books each steady step's whole cost. This module never sees Triton: `Engines` is
two calls (specdec/engines/wire.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec.engines.wire import NO_TOKEN, EngineBatch, EngineResult, Engines
from specdec.loop.admission import Admission, QueueFull
from specdec.loop.calibration import Calibration, CalibrationPlan, calibrate
from specdec.loop.config import SchedulerConfig
from specdec.loop.economics import Economics, StepShape
from specdec.loop.policy import ProposerPolicy, StepPlan
from specdec.loop.prefix_cache import PrefixCounts
from specdec.loop.proposers import REGISTRY
from specdec.loop.proposers.base import Proposal, Proposer
from specdec.loop.proposers.suffix import SuffixProposer
from specdec.loop.sequence import (
    CacheCopy,
    SequenceState,
    Update,
    engine_batch,
    no_token_error,
)
from specdec.loop.suffix_store import StoreCounts
from specdec.loop.timing import EngineCall, MeteredEngines
from specdec.loop.verify import Verdict, verify
from specdec.text.detokenizer import Decode
from specdec.text.request import GenerationRequest

__all__ = ["QueueFull", "SchedulerConfig", "SpeculativeScheduler", "IterationStats"]

NO_PROPOSAL = Proposal([])


@dataclass
class StepWork:
    """What one step runs: its plan, and the prefill that rides on it."""

    plan: StepPlan  # the batch's rows: proposers and k
    chunks: list[tuple[SequenceState, int]]  # prompt chunks prefilled beside it (row, tokens)
    target_copies: list[CacheCopy]
    draft_copies: list[CacheCopy]
    steady: bool  # no prompt joins or prefills: the step costs what a decode step costs


@dataclass
class Execution:
    """What the engines answered."""

    proposals: dict[int, Proposal]  # by sequence id
    result: EngineResult  # the target's
    target_batch: EngineBatch
    calls: list[EngineCall]


@dataclass
class IterationStats:
    """What the last step did, for metrics."""

    batch_size: int = 0
    num_waiting: int = 0
    chosen_k: int = 0  # the adaptive draft-model rows' k
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    emitted_per_row: list[int] = field(default_factory=list)
    # proposer -> [draft tokens, accepted]
    by_proposer: dict[str, list[int]] = field(default_factory=dict)
    draft_seconds: float = 0.0  # the draft model's calls (0 when no row drafted)
    target_seconds: float = 0.0  # the target's call
    num_draft_calls: int = 0
    draft_result_bytes: int = 0  # what the draft calls returned
    target_result_bytes: int = 0  # what the target call returned


@dataclass(frozen=True)
class LoopSnapshot:
    """The loop's state as the serving glue reads it: before a step (which requests to ask
    about cancellation) and after it (the metrics)."""

    running: tuple[SequenceState, ...]
    # The waiting sequences that will take a slot at the next step, in order.
    next_admitted: tuple[SequenceState, ...]
    num_waiting: int
    num_free_slots: int  # slots a waiting sequence may take now (cached prefixes give way)
    prefix_counts: PrefixCounts  # totals since start-up
    num_cached_prefixes: int
    suffix_store: StoreCounts | None = None  # the suffix proposer's store, where it runs


@dataclass
class StepResult:
    """What a step did: its responses' material, its stats, its shape for the cost model
    (None unless steady: specdec/loop/timing.py books it), and the loop's state after it."""

    snapshot: LoopSnapshot
    updates: list[Update] = field(default_factory=list)
    stats: IterationStats | None = None  # None: the step ran nothing
    shape: StepShape | None = None
    plan: StepPlan | None = None


class SpeculativeScheduler:
    def __init__(
        self,
        engines: Engines,
        config: SchedulerConfig,
        decode: Decode,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.engines = MeteredEngines(engines)
        self.config = config
        self.admission = Admission(
            config.num_slots, config.max_queue, decode, clock, config.prefix_min_tokens
        )
        self.proposers: dict[str, Proposer] = {
            name: REGISTRY[name](config, self.engines) for name in config.proposer_names
        }
        self.economics = Economics(config.max_draft_tokens, self.proposers.values())
        self.policy = ProposerPolicy(config, self.proposers, self.economics)

    # -- joining and leaving ---------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.admission.running or self.admission.waiting)

    def snapshot(self) -> LoopSnapshot:
        admission = self.admission
        free = admission.slots.num_free
        return LoopSnapshot(
            running=tuple(admission.running),
            next_admitted=tuple(itertools.islice(admission.waiting, free)),
            num_waiting=len(admission.waiting),
            num_free_slots=free,
            prefix_counts=dataclasses.replace(admission.slots.counts),
            num_cached_prefixes=len(admission.slots.cached),
            suffix_store=self._suffix_store_counts(),
        )

    def _suffix_store_counts(self) -> StoreCounts | None:
        proposer = self.proposers.get(SuffixProposer.name)
        if not isinstance(proposer, SuffixProposer):
            return None
        return dataclasses.replace(proposer.store.counts)

    def submit(self, request: GenerationRequest) -> SequenceState:
        """Queues a request; returns its first sequence (see submit_all for the others)."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[SequenceState]:
        """Queues every sequence of one client request, all or none (QueueFull)."""
        return self.admission.submit_all(requests)

    def cancel(self, sequence: SequenceState) -> None:
        self.admission.cancel(sequence)

    def fail_all(self, reason: str = "error") -> list[SequenceState]:
        """Ends every sequence (engine failure, shutdown); returns them for final responses."""
        ended = self.admission.end_all(reason)
        self._forget(ended)
        return ended

    def _forget(self, sequences: list[SequenceState]) -> None:
        for sequence in sequences:
            self.economics.release(sequence.id)
            for proposer in self.proposers.values():
                proposer.release(sequence)

    # -- start-up ----------------------------------------------------------------------------
    def calibrate(
        self, budget_s: float, clock: Callable[[], float] = time.perf_counter
    ) -> Calibration:
        """Measures the engines' costs on free slots before the first request
        (specdec/loop/calibration.py) and gives them to the cost model. Only before anything
        runs: it uses slots from 0 up (requests may wait meanwhile; only step() admits
        them)."""
        if self.admission.running:
            raise RuntimeError("calibrate before the first request runs")
        plan = CalibrationPlan.for_server(
            self.config.num_slots, self.config.max_draft_tokens, budget_s
        )
        with_draft = any(p.calls_model for p in self.proposers.values())
        calibration = calibrate(self.engines, plan, with_draft, clock)
        self.engines.take()  # not the first iteration's calls
        self.economics.calibrated(calibration)
        return calibration

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> StepResult:
        """Plans, executes and commits once for the running batch."""
        cancelled = self.admission.drop_cancelled()
        self._forget(cancelled)
        work = self.plan()
        if work is None:
            return StepResult(self.snapshot())
        execution = self.execute(work)
        updates, verdicts = self.commit(work, execution)
        for proposer in self.proposers.values():
            proposer.committed(work.plan.batch)
        self.economics.observe_calls(execution.calls, work.steady)
        self.economics.end_step(work.plan.calls)
        batch = work.plan.batch
        self._forget([s for s in batch if s.finished])
        self.admission.drop_finished()
        return StepResult(
            snapshot=self.snapshot(),
            updates=updates,
            stats=self._stats(work, execution, updates, verdicts),
            shape=self._shape(work, execution) if work.steady else None,
            plan=work.plan,
        )

    def plan(self) -> StepWork | None:
        """1. Admits waiting sequences, splits long prompts into chunks, and plans every
        row's proposals and the calls' cache copies (None: nothing to run)."""
        admitted = self.admission.admit()
        ready = [s for s in self.admission.running if self.admission.ready(s)]
        batch, chunks = self._split_prefills(ready)
        if not batch and not chunks:
            return None
        plan = self.policy.plan(batch)
        target_copies, draft_copies = self.admission.plan_copies(
            batch + [s for s, _ in chunks], plan.calls_a_model
        )
        # A step that prefills (a joining prompt, or chunks of one) is not what a decode step
        # costs: the cost model books neither its target call nor its whole cost.
        steady = not admitted and not chunks
        return StepWork(plan, chunks, target_copies, draft_copies, steady)

    def execute(self, work: StepWork) -> Execution:
        """2. The proposers' calls, then the target's."""
        proposals = self._propose(work.plan, work.draft_copies)
        for row, sequence in enumerate(work.plan.batch):  # a draft cut short (NO_TOKEN)
            proposed = len(proposals.get(sequence.id, NO_PROPOSAL).token_ids)
            work.plan.ks[row] = min(work.plan.ks[row], proposed)
        target_batch = self._target_batch(work, proposals)
        result = self.engines.target(target_batch)
        for sequence, num_tokens in work.chunks:  # their prompts' positions, written
            sequence.prefilled(num_tokens)
        return Execution(proposals, result, target_batch, self.engines.take())

    def commit(self, work: StepWork, execution: Execution) -> tuple[list[Update], list[Verdict]]:
        """3. Each row's verdict on its proposal (specdec/loop/verify.py), told to the cost
        model, and its tokens committed."""
        plan, result = work.plan, execution.result
        updates, verdicts = [], []
        for row, sequence in enumerate(plan.batch):
            k = plan.ks[row]
            proposal = execution.proposals.get(sequence.id, NO_PROPOSAL)
            target_ids = result.token_ids[row, : k + 1].tolist()  # (k + 1,)
            verdict = verify(proposal.token_ids, target_ids)
            name = plan.row_proposers[row]
            if name is not None:
                self.economics.observe_verdict(name, sequence.id, k, verdict.num_accepted)
            if any(proposal.hindsight):
                self.economics.observe_hindsight(_caller(plan, row), *proposal.hindsight)
            log_probs = result.log_probs[row] if result.log_probs.size else None
            updates.append(self._commit(sequence, k, verdict, log_probs))
            verdicts.append(verdict)
        return updates, verdicts

    def _propose(self, plan: StepPlan, copies: list[CacheCopy]) -> dict[int, Proposal]:
        """Sequence id -> its proposal, from each proposer for all its rows at once."""
        proposals = {}
        for name, rows in plan.calls.items():
            proposer = self.proposers[name]
            sequences = [plan.batch[r] for r in rows]
            ks = [plan.ks[r] for r in rows]
            own_copies = copies if proposer.calls_model else []
            for sequence, proposal in zip(
                sequences, proposer.propose(sequences, ks, own_copies), strict=True
            ):
                proposals[sequence.id] = proposal
        return proposals

    def _split_prefills(
        self, rows: list[SequenceState]
    ) -> tuple[list[SequenceState], list[tuple[SequenceState, int]]]:
        """(the step's batch, its prefill chunks). A row with more than prefill_chunk prompt
        tokens still to prefill feeds only a chunk of them this step and emits nothing, so a
        long prompt shares iterations with the running rows instead of stalling them. The
        chunks share one budget of prefill_chunk tokens per step, first come first served; a
        row left without budget sits the step out. A row with prefill_chunk or fewer left
        runs whole: it prefills the rest and emits its first token."""
        chunk = self.config.prefill_chunk
        if chunk is None:
            return rows, []
        batch, chunks, budget = [], [], chunk
        for sequence in rows:
            copying = sequence.copy_source_slot >= 0 and sequence.copy_from is not None
            cached = sequence.copy_length if copying else sequence.target_cache_length
            left = len(sequence.token_ids) - cached
            if left <= chunk:
                batch.append(sequence)
                continue
            num_tokens = min(budget, left - 1)
            if num_tokens > 0:
                chunks.append((sequence, num_tokens))
                budget -= num_tokens
        return batch, chunks

    @staticmethod
    def _target_batch(work: StepWork, proposals: dict[int, Proposal]) -> EngineBatch:
        """The batch's rows, then the prefill chunks' (whose one output is not read)."""
        batch, chunks = work.plan.batch, work.chunks
        rows = batch + [s for s, _ in chunks]
        target_batch = engine_batch(
            rows,
            pending=[
                s.token_ids[s.target_cache_length :] + proposals.get(s.id, NO_PROPOSAL).token_ids
                for s in batch
            ]
            + [s.token_ids[s.target_cache_length : s.target_cache_length + n] for s, n in chunks],
            cache_lengths=[s.target_cache_length for s in rows],
            num_steps=[k + 1 for k in work.plan.ks] + [1] * len(chunks),
            copies=work.target_copies,
        )
        wanted = [s.request.return_log_probs for s in rows]
        if any(wanted):
            target_batch.return_log_probs = np.array(wanted, dtype=np.bool_)
        return target_batch

    def _commit(
        self,
        sequence: SequenceState,
        k: int,
        verdict: Verdict,
        log_probs: np.ndarray | None = None,
    ) -> Update:
        """Appends the verdict's tokens up to the first stop condition. `log_probs`: (k + 1,)
        the target's log-probability of its token at each position, kept when the request
        returns log-probs (every emitted token is the target's own)."""
        request = sequence.request
        sequence.stats.num_target_passes += 1
        sequence.stats.num_draft_tokens += k
        sequence.stats.num_accepted_draft_tokens += verdict.num_accepted
        num_before = sequence.num_output_tokens
        for position, token in enumerate(verdict.token_ids):
            if token == NO_TOKEN:
                sequence.finish_reason, sequence.error = "error", no_token_error(sequence)
                break
            if token == request.end_id:
                sequence.finish_reason = "end"
                break
            sequence.token_ids.append(token)
            if request.return_log_probs:
                value = 0.0 if log_probs is None else float(log_probs[position])
                sequence.output_log_probs.append(value)
            if sequence.detokenizer.add(token):
                sequence.finish_reason = "stop"
            elif sequence.num_output_tokens >= request.max_tokens:
                sequence.finish_reason = "length"
            elif len(sequence.token_ids) > self.config.max_context:
                sequence.finish_reason = "length"
            if sequence.finish_reason:
                break
        if sequence.num_output_tokens > num_before:
            now, times = self.admission.clock(), sequence.times
            times.first_token_ns = times.first_token_ns or now
            times.previous_token_ns, times.last_token_ns = times.last_token_ns, now
        sequence.committed()
        if sequence.finished:
            self.admission.release(sequence)
        finished = sequence.finished
        text = sequence.detokenizer.take(final=finished) if (request.stream or finished) else ""
        return Update(sequence, text, finished, sequence.num_output_tokens - num_before)

    # -- what the step did -------------------------------------------------------------------
    def _stats(
        self,
        work: StepWork,
        execution: Execution,
        updates: list[Update],
        verdicts: list[Verdict],
    ) -> IterationStats:
        plan = work.plan
        drafts = [c for c in execution.calls if c.kind == "draft"]
        stats = IterationStats(
            batch_size=len(plan.batch),
            num_waiting=len(self.admission.waiting),
            chosen_k=plan.chosen_k,
            draft_seconds=sum(c.seconds for c in drafts),
            target_seconds=sum(c.seconds for c in execution.calls if c.kind == "target"),
            num_draft_calls=len(drafts),
            draft_result_bytes=sum(c.result_bytes for c in drafts),
            target_result_bytes=execution.result.nbytes,
        )
        for row, (update, verdict) in enumerate(zip(updates, verdicts, strict=True)):
            k, name = plan.ks[row], plan.row_proposers[row]
            if name is not None:
                counts = stats.by_proposer.setdefault(name, [0, 0])
                counts[0] += k
                counts[1] += verdict.num_accepted
            stats.num_draft_tokens += k
            stats.num_accepted_draft_tokens += verdict.num_accepted
            stats.emitted_per_row.append(update.num_emitted)
        return stats

    @staticmethod
    def _shape(work: StepWork, execution: Execution) -> StepShape:
        plan, target_batch = work.plan, execution.target_batch
        model_ks = [plan.ks[r] for rows in plan.calls.values() for r in rows if plan.row_model[r]]
        return StepShape(
            batch_size=len(plan.batch),
            num_tokens=len(target_batch.input_ids),
            num_widths=len(set(target_batch.input_lengths.tolist())),
            model_steps=max(model_ks) if model_ks else None,
        )


def _caller(plan: StepPlan, row: int) -> str:
    """The model proposer called for a row (hindsight comes only from a model's call)."""
    return next(name for name, rows in plan.calls.items() if row in rows and plan.row_model[row])
