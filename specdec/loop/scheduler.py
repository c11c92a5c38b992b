"""The speculate-verify loop with in-flight batching (arXiv 2211.17192, 2302.01318).

One `step()` serves every running sequence:
1. admission: waiting sequences take free KV slots (specdec/loop/admission.py);
2. plan: each row's proposer and k (specdec/loop/policy.py);
3. propose: each proposer proposes for all its rows at once; the draft model is called
   only when some row drafts with it (or catches up to probe);
4. verify: one target call checks every row's proposals;
5. commit: each row accepts its own prefix, plus a recovered or bonus token; a rejected
   draft token is rolled back by a shorter cache length.
This module never sees Triton: `Engines` is two calls (specdec/engines/wire.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec.engines.wire import EngineBatch, EngineResult, Engines
from specdec.loop.admission import Admission, QueueFull
from specdec.loop.calibration import Calibration, CalibrationPlan, calibrate
from specdec.loop.config import SchedulerConfig
from specdec.loop.controller import CostCurve
from specdec.loop.policy import ProposerPolicy, StepPlan
from specdec.loop.prefix_cache import PrefixCounts
from specdec.loop.proposers import REGISTRY
from specdec.loop.proposers.base import Proposal, Proposer, TimedStep
from specdec.loop.sequence import CacheCopy, SequenceState, Update, engine_batch
from specdec.loop.verify import Verdict, verify
from specdec.text.detokenizer import Decode
from specdec.text.request import GenerationRequest

__all__ = ["QueueFull", "SchedulerConfig", "SpeculativeScheduler", "IterationStats"]

NO_PROPOSAL = Proposal([])


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
    draft_seconds: float = 0.0  # the proposers' calls (0 when no row drafted)
    target_seconds: float = 0.0  # the target's call
    num_draft_calls: int = 0
    draft_result_bytes: int = 0  # what the draft calls returned
    target_result_bytes: int = 0  # what the target call returned


class MeteredEngines:
    """The loop's engines, counting the calls and the bytes each returns (IterationStats)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines
        self.num_draft_calls = 0
        self.draft_result_bytes = 0
        self.target_result_bytes = 0

    def draft(self, batch: EngineBatch) -> EngineResult:
        result = self.engines.draft(batch)
        self.num_draft_calls += 1
        self.draft_result_bytes += result.nbytes
        return result

    def target(self, batch: EngineBatch) -> EngineResult:
        result = self.engines.target(batch)
        self.target_result_bytes += result.nbytes
        return result

    def take_counts(self) -> tuple[int, int, int]:
        """(draft calls, draft bytes, target bytes) since the last take."""
        counts = (self.num_draft_calls, self.draft_result_bytes, self.target_result_bytes)
        self.num_draft_calls = self.draft_result_bytes = self.target_result_bytes = 0
        return counts


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
        self.target_cost = CostCurve()  # the target call's seconds by tokens verified
        self.proposers: dict[str, Proposer] = {
            name: REGISTRY[name](config, self.engines, self.target_cost)
            for name in config.proposers
        }
        self.policy = ProposerPolicy(config, self.proposers)
        self.last_plan: StepPlan | None = None
        self.last_iteration: IterationStats | None = None  # None: the last step ran nothing
        self._timed_step: TimedStep | None = None

    # -- joining and leaving ---------------------------------------------------------------
    @property
    def clock(self) -> Callable[[], int]:
        return self.admission.clock

    @clock.setter
    def clock(self, clock: Callable[[], int]) -> None:
        self.admission.clock = clock

    @property
    def waiting(self):  # collections.deque[SequenceState]
        return self.admission.waiting

    @property
    def running(self) -> list[SequenceState]:
        return self.admission.running

    @property
    def num_free_slots(self) -> int:
        """Slots a waiting sequence may take now (cached prefixes give theirs way)."""
        return self.admission.slots.num_free

    @property
    def prefix_counts(self) -> PrefixCounts:
        return self.admission.slots.counts

    @property
    def num_cached_prefixes(self) -> int:
        return len(self.admission.slots.cached)

    @property
    def has_work(self) -> bool:
        return bool(self.admission.running or self.admission.waiting)

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
            for proposer in self.proposers.values():
                proposer.release(sequence)

    # -- start-up ----------------------------------------------------------------------------
    def calibrate(
        self, budget_s: float, clock: Callable[[], float] = time.perf_counter
    ) -> Calibration:
        """Measures the engines' costs on free slots before the first request
        (specdec/loop/calibration.py) and gives them to the cost curves: the target's, which
        every proposer prices verifies by, and each proposer's own (the draft's steps).
        Only before anything runs: it uses slots from 0 up (requests may wait meanwhile;
        only step() admits them)."""
        if self.admission.running:
            raise RuntimeError("calibrate before the first request runs")
        plan = CalibrationPlan.for_server(
            self.config.num_slots, self.config.max_draft_tokens, budget_s
        )
        with_draft = any(p.calls_model for p in self.proposers.values())
        calibration = calibrate(self.engines, plan, with_draft, clock)
        self.engines.take_counts()  # not the first iteration's
        for (rows, tokens), seconds in calibration.target.items():
            self.target_cost.calibrate(rows * tokens, seconds)
        for proposer in self.proposers.values():
            proposer.calibrated(calibration)
        return calibration

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> list[Update]:
        """Plans, proposes, verifies and commits once for the running batch."""
        self.last_iteration = None
        cancelled = self.admission.drop_cancelled()
        if cancelled:
            self._forget(cancelled)
            self._timed_step = None
        admitted = self.admission.admit()
        ready = [s for s in self.admission.running if self.admission.ready(s)]
        batch, chunks = self._split_prefills(ready)
        if not batch and not chunks:
            return []
        # A step that prefills (a joining prompt, or chunks of one) is not what a decode step
        # costs: neither the target's cost curve nor the proposers' step cost books it.
        steady = not admitted and not chunks
        step_start = time.perf_counter()
        self._close_timed_step(step_start)
        plan = self.last_plan = self.policy.plan(batch)
        calls_a_model = self.policy.calls_a_model(plan)
        chunk_rows = [s for s, _ in chunks]
        target_copies, draft_copies = self.admission.plan_copies(batch + chunk_rows, calls_a_model)
        draft_start = time.perf_counter()
        proposals = self._propose(batch, plan, draft_copies)
        draft_seconds = time.perf_counter() - draft_start
        target_batch = self._target_batch(batch, plan, proposals, target_copies, chunks)
        start = time.perf_counter()
        result = self.engines.target(target_batch)
        target_seconds = time.perf_counter() - start
        for sequence, num_tokens in chunks:  # their prompts' positions, written; no output
            sequence.target_cache_length += num_tokens
        if steady:
            self.target_cost.observe(len(target_batch.input_ids), target_seconds, len(batch))
        num_draft_calls, draft_bytes, target_bytes = self.engines.take_counts()
        stats = IterationStats(
            batch_size=len(batch),
            num_waiting=len(self.admission.waiting),
            chosen_k=plan.chosen_k,
            draft_seconds=draft_seconds if plan.calls else 0.0,
            target_seconds=target_seconds,
            num_draft_calls=num_draft_calls,
            draft_result_bytes=draft_bytes,
            target_result_bytes=target_bytes,
        )
        updates = self._verify_and_commit(batch, plan, proposals, result, stats)
        if steady:
            self._timed_step = TimedStep(
                start=step_start,
                busy=time.perf_counter() - step_start,
                batch_size=len(batch),
                num_tokens=len(target_batch.input_ids),
                num_widths=len(set(target_batch.input_lengths.tolist())),
                model_drafted=calls_a_model,
            )
        for proposer in self.proposers.values():
            proposer.end_step()
        self._forget([s for s in batch if s.finished])
        self.admission.drop_finished()
        if not self.admission.running:  # the loop now waits for a request: no step's cost
            self._timed_step = None
        self.last_iteration = stats
        return updates

    def _close_timed_step(self, now: float) -> None:
        """Books the last steady step's whole cost, unless the loop idled after it."""
        timed, self._timed_step = self._timed_step, None
        if timed is None or now - timed.start >= 3 * timed.busy:  # the loop waited for work
            return
        for proposer in self.proposers.values():
            proposer.observe_iteration(timed, now - timed.start)

    def _propose(
        self, batch: list[SequenceState], plan: StepPlan, copies: list[CacheCopy]
    ) -> dict[int, Proposal]:
        """Sequence id -> its proposal, from each proposer for all its rows at once."""
        proposals = {}
        for name, rows in plan.calls.items():
            proposer = self.proposers[name]
            sequences = [batch[r] for r in rows]
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

    def _target_batch(
        self,
        batch: list[SequenceState],
        plan: StepPlan,
        proposals: dict[int, Proposal],
        copies: list[CacheCopy],
        chunks: list[tuple[SequenceState, int]],
    ) -> EngineBatch:
        """The batch's rows, then the prefill chunks' (whose one output is not read)."""
        rows = batch + [s for s, _ in chunks]
        target_batch = engine_batch(
            rows,
            pending=[
                s.token_ids[s.target_cache_length :] + proposals.get(s.id, NO_PROPOSAL).token_ids
                for s in batch
            ]
            + [s.token_ids[s.target_cache_length : s.target_cache_length + n] for s, n in chunks],
            cache_lengths=[s.target_cache_length for s in rows],
            num_steps=[k + 1 for k in plan.ks] + [1] * len(chunks),
            copies=copies,
        )
        wanted = [s.request.return_log_probs for s in rows]
        if any(wanted):
            target_batch.return_log_probs = np.array(wanted, dtype=np.bool_)
        return target_batch

    def _verify_and_commit(
        self,
        batch: list[SequenceState],
        plan: StepPlan,
        proposals: dict[int, Proposal],
        result: EngineResult,
        stats: IterationStats,
    ) -> list[Update]:
        """Each row's verdict on its proposal (specdec/loop/verify.py), told to its proposer
        and committed."""
        updates = []
        for row, sequence in enumerate(batch):
            k = plan.ks[row]
            proposal = proposals.get(sequence.id, NO_PROPOSAL)
            target_ids = result.token_ids[row, : k + 1].tolist()  # (k + 1,)
            verdict = verify(proposal.token_ids, target_ids)
            log_probs = result.log_probs[row] if result.log_probs.size else None
            name = plan.proposers[row]
            if name is not None:
                self.proposers[name].observe(sequence, k, verdict.num_accepted)
                counts = stats.by_proposer.setdefault(name, [0, 0])
                counts[0] += k
                counts[1] += verdict.num_accepted
            before = sequence.num_output_tokens
            updates.append(self._commit(sequence, k, verdict, log_probs))
            stats.num_draft_tokens += k
            stats.num_accepted_draft_tokens += verdict.num_accepted
            stats.emitted_per_row.append(sequence.num_output_tokens - before)
        return updates

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
            now = self.admission.clock()
            sequence.times.first_token_ns = sequence.times.first_token_ns or now
            sequence.times.last_token_ns = now
        # Valid cache prefixes: everything but the newest token (it was never fed).
        sequence.target_cache_length = len(sequence.token_ids) - 1
        sequence.draft_cache_length = min(sequence.draft_cache_length, len(sequence.token_ids) - 1)
        if sequence.finished:
            self.admission.release(sequence)
        finished = sequence.finished
        text = sequence.detokenizer.take(final=finished) if (request.stream or finished) else ""
        return Update(sequence, text, finished)
