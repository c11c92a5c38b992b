"""The speculate-verify loop with in-flight batching (arXiv 2211.17192, 2302.01318).

One `step()` serves every running sequence: each row gets its draft tokens from a proposer
(the draft model, in one call for all its rows; or prompt lookup, with no model call), one
target call verifies all rows, and each row accepts its own prefix. Sequences join at step
boundaries while KV slots are free and leave when done; the caches of both engines are
addressed by the sequence's slot, and a rejected draft token is rolled back by a shorter
cache length. A request may carry several prompts and ask for several sequences of each
(num_return_sequences): every one is a row of its own; the first sequence of a prompt
fills the prompt's cache and the others copy it into their slots at their first step.
This module never sees Triton: `Engines` is two calls.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specdec.engines.wire import LOOKBACK_TOKENS, EngineBatch, EngineResult
from specdec.loop.controller import AcceptanceWindow, AdaptiveController, Choice, CostCurve
from specdec.loop.ngram import DEFAULT_MATCH_LENGTHS, NgramCandidate, NgramIndex, plan_ngram_tokens
from specdec.loop.rejection import Verdict, rejection_sample, verify_greedy
from specdec.text.detokenizer import Decode, IncrementalDetokenizer
from specdec.text.request import PROPOSERS, GenerationRequest


class Engines(Protocol):
    def draft(self, batch: EngineBatch) -> EngineResult: ...
    def target(self, batch: EngineBatch) -> EngineResult: ...


@dataclass
class SchedulerConfig:
    num_slots: int  # KV cache slots per engine: the most sequences running at once
    max_context: int  # positions per slot
    max_draft_tokens: int  # upper bound on k
    default_draft_tokens: int | None  # k for requests without num_draft_tokens; None: adaptive
    max_queue: int = 1024  # waiting requests beyond this are refused
    proposers: tuple[str, ...] = PROPOSERS  # those the server runs, in order of preference
    ngram_match_lengths: tuple[int, ...] = DEFAULT_MATCH_LENGTHS


# Prompt lookup's plan must promise this much more goodput than plain decoding: the cost
# curve and the acceptance estimates are noisy, and a lost bet costs verify time.
NGRAM_MARGIN = 1.05
# A row with a match whose lookups have not been verified for this many iterations proposes
# one token: its acceptance estimate would otherwise never recover from a bad start.
NGRAM_PROBE_EVERY = 16
ROW_WINDOW = 16  # a row's own acceptance window: rows differ, and a request is short


@dataclass
class TimedStep:
    """A steady step (no prefill) whose whole cost is measured from its start to the next
    step's start, so that the glue's work between steps (responses, cancellation checks)
    counts too."""

    start: float
    busy: float  # seconds inside step(); a much longer gap means the loop idled after it
    batch_size: int
    k: int  # the draft controller's choice
    probe: bool
    by_choice: bool  # every row ran the controller's choice: the controller may book it
    tokens: int | None  # tokens verified, where no draft model ran: the lookup plan's price


@dataclass
class SequenceStats:
    num_draft_tokens: int = 0  # proposed
    num_accepted_draft_tokens: int = 0
    num_target_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_draft_tokens / self.num_draft_tokens


@dataclass
class SequenceTimes:
    """Unix time in ns (TensorRT-LLM's *_time_ns outputs); 0 until it happened."""

    arrival_ns: int = 0  # submitted
    first_scheduled_ns: int = 0  # got its slot
    first_token_ns: int = 0  # its first output token was committed
    last_token_ns: int = 0  # its latest output token was committed


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
    draft_seconds: float = 0.0  # the draft model's call (0 when no row drafted)
    target_seconds: float = 0.0  # the target's call


@dataclass
class Sequence:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    id: int = 0
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    target_cache_length: int = 0
    draft_cache_length: int = 0
    num_draft_tokens: int = 0  # k of the current step
    proposer: str | None = None  # where this step's draft tokens come from
    ngram_index: NgramIndex = field(default_factory=NgramIndex)
    ngram_proposal: list[int] = field(default_factory=list)  # this step's lookup
    ngram_match_length: int = 0  # the n of this step's lookup
    ngram_acceptance: AcceptanceWindow | None = None  # this row's, once it used lookup
    ngram_idle: int = 0  # iterations with a match that was not verified
    stats: SequenceStats = field(default_factory=SequenceStats)
    finish_reason: str | None = None  # "end", "length", "stop", "cancelled", "error"
    cancelled: bool = False
    sequence_index: int = 0  # which of its prompt's num_return_sequences
    parent: Sequence | None = None  # its prompt's first sequence, whose prompt cache it copies
    copy_source_slot: int = -1  # >= 0: copy the prompt's cache from there at the first step
    num_copied_positions: int = 0  # cache positions copied instead of computed
    output_log_probs: list[float] = field(default_factory=list)  # one per output token
    times: SequenceTimes = field(default_factory=SequenceTimes)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_ids)

    @property
    def num_cache_positions(self) -> int:
        """Positions of its target slot it holds (copied ones included)."""
        return max(self.target_cache_length, self.num_copied_positions)


@dataclass
class Update:
    """What one step did for one sequence: the glue turns it into a response."""

    sequence: Sequence
    text: str  # new text ("" when the step added none that is complete)
    finished: bool


class QueueFull(RuntimeError):
    pass


class SpeculativeScheduler:
    def __init__(
        self,
        engines: Engines,
        config: SchedulerConfig,
        decode: Decode,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.engines = engines
        self.config = config
        self.decode = decode
        self.clock = clock  # for SequenceTimes
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        # A heap: the lowest free slot first, so a batch's slots stay close together (the
        # engine's batched attention reads the slot range it spans).
        self.free_slots = list(range(config.num_slots))
        self._ids = itertools.count()
        self.controller = AdaptiveController(config.max_draft_tokens)  # the draft model's k
        # Every row's lookups, by match length: a 3-token match is a surer guess than one token.
        self.ngram_acceptance = {
            n: AcceptanceWindow(config.max_draft_tokens) for n in config.ngram_match_lengths
        }
        self.last_iteration: IterationStats | None = None  # None: the last step ran nothing
        self._timed_step: TimedStep | None = None
        # Whole steady iterations without a draft model call, by tokens verified: what the
        # lookup plan prices its tokens by. A target-call price saw neither the loop's own
        # work per proposed token (lookups, verdicts) nor the responses and checks that every
        # iteration pays at any k; at 64 grounded streams it planned a 5% gain and got a 4%
        # loss. Priced by whole iterations the plan proposes more there, not less: the shared
        # per-iteration costs outweigh the per-token work (docs/benchmarks.md, fifth run).
        self.iteration_cost_by_tokens = CostCurve()

    # -- joining and leaving ---------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Sequence:
        """Queues a request; returns its first sequence (see submit_all for the others)."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[Sequence]:
        """Queues every sequence of one client request (each prompt's num_return_sequences,
        in order), all or none."""
        count = sum(r.num_return_sequences for r in requests)
        # Requests that will get a free slot at the next step are not queued behind anyone.
        if len(self.waiting) + count > self.config.max_queue + len(self.free_slots):
            raise QueueFull(f"queue full ({self.config.max_queue} requests waiting for a slot)")
        now = self.clock()
        sequences = []
        for request in requests:
            parent = None
            for index in range(request.num_return_sequences):
                sequence = self._new_sequence(request, index, parent)
                sequence.times.arrival_ns = now
                parent = parent or sequence
                sequences.append(sequence)
        self.waiting.extend(sequences)
        return sequences

    def _new_sequence(self, request: GenerationRequest, index: int, parent) -> Sequence:
        generator = torch.Generator()
        if request.seed is None:
            generator.seed()
        else:  # the request's seed for its first sequence; the others get their own
            generator.manual_seed((request.seed + index * 0x9E3779B97F4A7C15) % 2**63)
        return Sequence(
            request=request,
            detokenizer=IncrementalDetokenizer(self.decode, request.stop_words),
            generator=generator,
            id=next(self._ids),
            token_ids=list(request.prompt_ids),
            ngram_index=NgramIndex(self.config.ngram_match_lengths),
            sequence_index=index,
            parent=parent,
        )

    def cancel(self, sequence: Sequence) -> None:
        sequence.cancelled = True

    def fail_all(self, reason: str = "error") -> list[Sequence]:
        """Ends every sequence (engine failure, shutdown); returns them for final responses."""
        ended = list(self.running) + list(self.waiting)
        for sequence in ended:
            sequence.finish_reason = reason
            self._release(sequence)
        self.running, self.waiting = [], collections.deque()
        return ended

    def _release(self, sequence: Sequence) -> None:
        if sequence.slot >= 0:
            heapq.heappush(self.free_slots, sequence.slot)
            sequence.slot = -1

    def _admit(self) -> int:
        admitted = 0
        now = self.clock()
        while self.waiting and self.free_slots:
            sequence = self.waiting.popleft()
            if sequence.cancelled:
                continue
            sequence.slot = heapq.heappop(self.free_slots)
            sequence.times.first_scheduled_ns = now
            parent = sequence.parent
            # The parent's slot holds the prompt (once prefilled) for as long as it runs.
            if parent is not None and parent.slot >= 0 and len(sequence.token_ids) > 1:
                sequence.copy_source_slot = parent.slot
            self.running.append(sequence)
            admitted += 1
        return admitted

    @staticmethod
    def _ready(sequence: Sequence) -> bool:
        """False while the sequence waits for its parent's prefill to copy it."""
        parent = sequence.parent
        if sequence.copy_source_slot < 0 or parent.stats.num_target_passes > 0:
            return True
        if parent.slot < 0 or parent.cancelled:  # nothing to copy after all: prefill
            sequence.copy_source_slot = -1
            return True
        return False

    @staticmethod
    def _plan_copies(batch: list[Sequence], drafting: bool) -> tuple[list, list]:
        """(target copies, draft copies) as (source slot, slot, positions) for the rows that
        start from their parent's prompt cache; sets their cache lengths to match. The
        draft's copy rides on this step's draft call; without one the draft catches up."""
        target_copies, draft_copies = [], []
        for sequence in batch:
            if sequence.copy_source_slot < 0:
                continue
            source, parent = sequence.copy_source_slot, sequence.parent
            length = len(sequence.request.prompt_ids) - 1  # the last prompt token is fed
            target_copies.append((source, sequence.slot, length))
            sequence.target_cache_length = sequence.num_copied_positions = length
            draft_length = min(parent.draft_cache_length, length)
            if drafting and draft_length > 0:
                draft_copies.append((source, sequence.slot, draft_length))
                sequence.draft_cache_length = draft_length
            sequence.copy_source_slot = -1
        return target_copies, draft_copies

    def _drop_cancelled(self) -> list[Sequence]:
        cancelled = [s for s in self.running if s.cancelled]
        for sequence in cancelled:
            sequence.finish_reason = "cancelled"
            self._release(sequence)
        self.running = [s for s in self.running if not s.cancelled]
        self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        return cancelled

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- one iteration ---------------------------------------------------------------------
    def _cap(self, sequence: Sequence, k: int) -> int:
        """No proposals past max_tokens or past the end of the slot."""
        remaining = sequence.request.max_tokens - sequence.num_output_tokens - 1
        room = self.config.max_context - len(sequence.token_ids)
        return max(0, min(k, self.config.max_draft_tokens, remaining, room))

    def _row_limit(self, sequence: Sequence) -> tuple[int, bool]:
        """The row's most draft tokens per step, and whether it wants exactly that many: a
        request's num_draft_tokens caps k (exactly with fixed_num_draft_tokens); without it a
        numeric server default is exact, and "adaptive" caps at max_draft_tokens."""
        request = sequence.request
        if request.num_draft_tokens is not None:
            return request.num_draft_tokens, request.fixed_num_draft_tokens
        default = self.config.default_draft_tokens
        if default is not None:
            return default, True
        return self.config.max_draft_tokens, False

    def _choose_num_draft_tokens(
        self, batch: list[Sequence]
    ) -> tuple[Choice, bool, Sequence | None]:
        """Each row's proposer and k. Exact k where the request (or the server default) asks
        for it. Otherwise prompt lookup where its plan pays (it costs no model call), and the
        draft model's goodput controller for the rest. Also says whether every row followed
        the controller's choice, and which row's draft catches up to probe (see
        _lookback_probe)."""
        draft_rows, lookup_rows, fixed_ks = [], [], []
        for sequence in batch:
            sequence.num_draft_tokens, sequence.proposer = 0, None
            limit, exact = self._row_limit(sequence)
            proposers = (sequence.request.proposer,) if sequence.request.proposer else None
            proposers = proposers or self.config.proposers
            if limit == 0 or not proposers:
                fixed_ks.append(0)
            elif exact and proposers[0] == "ngram":
                self._use_lookup(sequence, limit)
            elif exact:
                self._use_draft(sequence, limit)
                fixed_ks.append(sequence.num_draft_tokens)
            else:
                if "ngram" in proposers:
                    lookup_rows.append(sequence)
                if "draft_model" in proposers:
                    draft_rows.append(sequence)
        self._plan_lookup(lookup_rows, len(batch))
        draft_rows = [s for s in draft_rows if s.proposer is None]
        choice = self.controller.choose(len(draft_rows), fixed_ks)
        for sequence in draft_rows:
            self._use_draft(sequence, min(choice.k, self._row_limit(sequence)[0]))
        lookback_row = None
        if choice.probe and draft_rows:
            lookback_row = self._lookback_probe(draft_rows)
            if lookback_row is None:
                self._use_draft(draft_rows[0], 1)
        return choice, len(draft_rows) == len(batch), lookback_row

    def _use_draft(self, sequence: Sequence, k: int) -> None:
        sequence.num_draft_tokens = self._cap(sequence, k)
        sequence.proposer = "draft_model" if sequence.num_draft_tokens else None

    def _look_up(self, sequence: Sequence, k: int) -> None:
        """The row's lookup proposal of up to k tokens, not yet chosen for the verify."""
        index = sequence.ngram_index
        sequence.ngram_proposal = index.propose(sequence.token_ids, self._cap(sequence, k))
        sequence.ngram_match_length = index.match_length

    def _use_lookup(self, sequence: Sequence, k: int) -> None:
        self._look_up(sequence, k)
        sequence.num_draft_tokens = len(sequence.ngram_proposal)
        sequence.proposer = "ngram" if sequence.ngram_proposal else None

    def _plan_lookup(self, rows: list[Sequence], batch_size: int) -> None:
        """Prompt lookup for the rows where it pays: each row's own acceptance (shrunk towards
        every row's) against the target's measured cost by tokens verified. A row with a
        match left unverified for NGRAM_PROBE_EVERY iterations tries one token."""
        candidates = []
        shared = {n: window.rates() for n, window in self.ngram_acceptance.items()}
        for i, sequence in enumerate(rows):
            self._look_up(sequence, self._row_limit(sequence)[0])
            if sequence.ngram_proposal:
                own = sequence.ngram_acceptance
                prior = shared[sequence.ngram_match_length]
                rates = own.rates(prior) if own is not None else prior
                candidates.append(NgramCandidate(i, len(sequence.ngram_proposal), rates))
        if not candidates:
            return
        plan = plan_ngram_tokens(
            candidates, batch_size, self._verify_cost(batch_size), NGRAM_MARGIN
        )
        for candidate in candidates:
            sequence = rows[candidate.row]
            k = plan.get(candidate.row, 0)
            if k == 0:
                sequence.ngram_idle += 1
                if sequence.ngram_idle < NGRAM_PROBE_EVERY:
                    continue
                k = 1
            sequence.ngram_idle = 0
            sequence.ngram_proposal = sequence.ngram_proposal[:k]
            sequence.num_draft_tokens, sequence.proposer = k, "ngram"

    def _observe_lookup(self, sequence: Sequence, num_accepted: int) -> None:
        k = sequence.num_draft_tokens
        if sequence.ngram_acceptance is None:
            sequence.ngram_acceptance = AcceptanceWindow(
                self.config.max_draft_tokens, window=ROW_WINDOW
            )
        sequence.ngram_acceptance.observe(k, num_accepted)
        self.ngram_acceptance[sequence.ngram_match_length].observe(k, num_accepted)

    def _verify_cost(self, batch_size: int):
        """Seconds of an iteration by tokens verified: whole iterations as measured, or the
        target call's until one has been. Until a verify longer than plain decoding's has
        been measured, extra tokens are priced at nothing, so that one verify is tried and
        measured (extrapolating from plain decoding alone would price each token as a whole
        row, and lookups would never start)."""
        curve = self.iteration_cost_by_tokens
        if not curve.sizes:
            curve = self.controller.target_cost
        if curve.sizes and curve.sizes[-1] <= batch_size:
            plain = curve.estimate(batch_size)
            return lambda num_tokens: plain
        return curve.estimate

    def _lookback_probe(self, adaptive: list[Sequence]) -> Sequence | None:
        """A probe that costs no verify: a greedy row's draft catches up on the output tokens
        plain decoding produced since its last call (proposing none), and its hindsight
        guesses of them are first-position verdicts; the target call stays plain decoding's.
        The row with the most such tokens (up to the lookback) and the least catch-up.
        None if no greedy row has any: a sampled row's tokens are draws, not the argmax."""
        best, best_key = None, None
        for sequence in adaptive:
            samples = len(sequence.token_ids) - max(
                sequence.draft_cache_length + 1, len(sequence.request.prompt_ids)
            )
            if not sequence.request.greedy or samples <= 0:
                continue
            key = (min(samples, LOOKBACK_TOKENS), -samples)
            if best_key is None or key > best_key:
                best, best_key = sequence, key
        return best

    def step(self) -> list[Update]:
        """Runs one draft call and one target call over the running batch."""
        self.last_iteration = None
        if self._drop_cancelled():
            self._timed_step = None
        admitted = self._admit()
        batch = [s for s in self.running if self._ready(s)]
        if not batch:
            return []
        step_start = time.perf_counter()
        self._close_timed_step(step_start)
        choice, all_adaptive, lookback_row = self._choose_num_draft_tokens(batch)
        drafting = [s for s in batch if s.proposer == "draft_model" or s is lookback_row]
        target_copies, draft_copies = self._plan_copies(batch, bool(drafting))
        draft_start = time.perf_counter()
        proposals = self._propose(drafting, draft_copies) if drafting else {}
        draft_seconds = time.perf_counter() - draft_start
        for sequence in batch:
            if sequence.proposer == "ngram":
                proposals[sequence.id] = (sequence.ngram_proposal, None)  # point masses
        target_batch = self._target_batch(batch, proposals, target_copies)
        start = time.perf_counter()
        result = self.engines.target(target_batch)
        target_seconds = time.perf_counter() - start
        if not admitted:  # a prefill is not what a decode step costs
            self.controller.observe_target(len(target_batch.input_ids), target_seconds)
        stats = IterationStats(
            batch_size=len(batch),
            num_waiting=len(self.waiting),
            chosen_k=choice.k,
            draft_seconds=draft_seconds if drafting else 0.0,
            target_seconds=target_seconds,
        )
        updates = []
        probs_row = 0
        for row, sequence in enumerate(batch):
            k = sequence.num_draft_tokens
            draft_ids, draft_probs = proposals.get(sequence.id, ([], None))
            if sequence.request.greedy:
                verdict = verify_greedy(draft_ids, result.token_ids[row, : k + 1].tolist())
                log_probs = result.log_probs[row] if result.log_probs.size else None
            else:
                target_probs = torch.from_numpy(result.probs[probs_row : probs_row + k + 1])
                probs_row += k + 1
                verdict = rejection_sample(draft_ids, draft_probs, target_probs, sequence.generator)
                log_probs = target_probs  # (k + 1, V): emitted token j has p[j, token]
            if sequence.proposer == "ngram":
                self._observe_lookup(sequence, verdict.num_accepted)
            else:
                self.controller.observe_verdict(k, verdict.num_accepted)
            if sequence.proposer is not None:
                counts = stats.by_proposer.setdefault(sequence.proposer, [0, 0])
                counts[0] += k
                counts[1] += verdict.num_accepted
            before = sequence.num_output_tokens
            updates.append(self._commit(sequence, verdict, log_probs))
            stats.num_draft_tokens += k
            stats.num_accepted_draft_tokens += verdict.num_accepted
            stats.emitted_per_row.append(sequence.num_output_tokens - before)
        # A prefill is no steady step. The draft controller books only a step that ran its
        # choice for every row (`by_choice`: no rows with a k of their own, or a batch of
        # fixed k = 4 rows would be booked as the cost of k = 0), a probe as a probe; the
        # lookup plan's curve only a step without a draft model call (`tokens`).
        if not admitted:
            self._timed_step = TimedStep(
                start=step_start,
                busy=time.perf_counter() - step_start,
                batch_size=len(batch),
                k=choice.k,
                probe=choice.probe,
                by_choice=all_adaptive,
                tokens=None if drafting else len(target_batch.input_ids),
            )
        self.controller.end_iteration(drafted=bool(drafting))
        self.running = [s for s in self.running if s.finish_reason is None]
        if not self.running:  # the loop now waits for a request: that wait is no step's cost
            self._timed_step = None
        self.last_iteration = stats
        return updates

    def _close_timed_step(self, now: float) -> None:
        """Records the last steady step's whole cost, unless the loop idled after it."""
        timed, self._timed_step = self._timed_step, None
        if timed is None or now - timed.start >= 3 * timed.busy:  # the loop waited for work
            return
        seconds = now - timed.start
        if timed.tokens is not None:
            self.iteration_cost_by_tokens.observe(timed.tokens, seconds)
        if timed.by_choice and timed.probe:
            self.controller.observe_probe(timed.batch_size, seconds)
        elif timed.by_choice:
            self.controller.observe_iteration(timed.batch_size, timed.k, seconds)

    def _propose(
        self, drafting: list[Sequence], copies: list[tuple[int, int, int]]
    ) -> dict[int, tuple[list[int], torch.Tensor]]:
        batch = self._engine_batch(
            drafting,
            pending=[s.token_ids[s.draft_cache_length :] for s in drafting],
            cache_lengths=[s.draft_cache_length for s in drafting],
            num_steps=[s.num_draft_tokens for s in drafting],
            copies=copies,
        )
        start = time.perf_counter()
        result = self.engines.draft(batch)
        num_steps = int(batch.num_steps.max())
        # A catch-up or prefill would blur the cost of a step.
        if int(batch.input_lengths.max()) <= 2 and num_steps > 0:
            self.controller.observe_draft(len(drafting), num_steps, time.perf_counter() - start)
        proposals = {}
        probs_row = 0
        for row, sequence in enumerate(drafting):
            k = sequence.num_draft_tokens
            self._observe_lookback(sequence, result.lookback(row))
            draft_probs = None
            if not sequence.request.greedy:
                draft_probs = torch.from_numpy(result.probs[probs_row : probs_row + k])
                probs_row += k
            proposals[sequence.id] = (result.token_ids[row, :k].tolist(), draft_probs)
            # The draft cached everything it was fed: the pending tokens and k - 1 proposals.
            sequence.draft_cache_length = len(sequence.token_ids) + max(k - 1, 0)
        return proposals

    def _observe_lookback(self, sequence: Sequence, guesses: list[int]) -> None:
        """Scores the draft's hindsight guesses of the tokens it was just fed (the last
        len(guesses) of the sequence; only a greedy row's catch-up has any, see
        engine.lookback_lengths) against what greedy decoding produced there."""
        if not guesses:
            return
        first = len(sequence.token_ids) - len(guesses)  # the index of the first guessed token
        skip = max(0, len(sequence.request.prompt_ids) - first)  # prompt tokens are not output
        actual = sequence.token_ids[first + skip :]
        hits = sum(g == t for g, t in zip(guesses[skip:], actual, strict=True))
        self.controller.observe_lookback(hits, len(actual))

    def _target_batch(
        self, batch: list[Sequence], proposals: dict, copies: list[tuple[int, int, int]]
    ) -> EngineBatch:
        target_batch = self._engine_batch(
            batch,
            pending=[
                s.token_ids[s.target_cache_length :] + proposals.get(s.id, ([], None))[0]
                for s in batch
            ],
            cache_lengths=[s.target_cache_length for s in batch],
            num_steps=[s.num_draft_tokens + 1 for s in batch],
            copies=copies,
        )
        wanted = [s.request.return_log_probs and s.request.greedy for s in batch]
        if any(wanted):
            target_batch.return_log_probs = np.array(wanted, dtype=np.bool_)
        return target_batch

    def _engine_batch(
        self,
        rows: list[Sequence],
        pending: list[list[int]],
        cache_lengths: list[int],
        num_steps: list[int],
        copies: list[tuple[int, int, int]] = (),
    ) -> EngineBatch:
        requests = [s.request for s in rows]
        copy_columns = np.array(copies, dtype=np.int32).reshape(-1, 3).T  # (3, C)
        return EngineBatch(
            input_ids=np.array([t for p in pending for t in p], dtype=np.int64),
            input_lengths=np.array([len(p) for p in pending], dtype=np.int32),
            slot_ids=np.array([s.slot for s in rows], dtype=np.int32),
            cache_lengths=np.array(cache_lengths, dtype=np.int32),
            num_steps=np.array(num_steps, dtype=np.int32),
            temperature=np.array([r.temperature for r in requests], dtype=np.float32),
            top_k=np.array([r.top_k for r in requests], dtype=np.int32),
            top_p=np.array([r.top_p for r in requests], dtype=np.float32),
            end_ids=np.array([r.end_id for r in requests], dtype=np.int32),
            min_tokens_left=np.array(
                [max(0, s.request.min_tokens - s.num_output_tokens) for s in rows],
                dtype=np.int32,
            ),
            seeds=np.array(
                [int(torch.randint(2**62, (), generator=s.generator)) for s in rows],
                dtype=np.int64,
            ),
            copy_src_slots=copy_columns[0].copy(),
            copy_dst_slots=copy_columns[1].copy(),
            copy_lengths=copy_columns[2].copy(),
        )

    def _commit(self, sequence: Sequence, verdict: Verdict, log_probs=None) -> Update:
        """Appends the verdict's tokens up to the first stop condition. `log_probs`: the
        target's log-probabilities by position ((k + 1,) greedy) or its (k + 1, V)
        distributions (sampled), kept when the request returns log-probs."""
        request = sequence.request
        sequence.stats.num_target_passes += 1
        sequence.stats.num_draft_tokens += sequence.num_draft_tokens
        sequence.stats.num_accepted_draft_tokens += verdict.num_accepted
        num_before = sequence.num_output_tokens
        for position, token in enumerate(verdict.token_ids):
            if token == request.end_id:
                sequence.finish_reason = "end"
                break
            sequence.token_ids.append(token)
            if request.return_log_probs:
                sequence.output_log_probs.append(_log_prob(log_probs, position, token))
            if sequence.detokenizer.add(token):
                sequence.finish_reason = "stop"
            elif sequence.num_output_tokens >= request.max_tokens:
                sequence.finish_reason = "length"
            elif len(sequence.token_ids) > self.config.max_context:
                sequence.finish_reason = "length"
            if sequence.finish_reason:
                break
        if sequence.num_output_tokens > num_before:
            now = self.clock()
            sequence.times.first_token_ns = sequence.times.first_token_ns or now
            sequence.times.last_token_ns = now
        # Valid cache prefixes: everything but the newest token (it was never fed).
        sequence.target_cache_length = len(sequence.token_ids) - 1
        sequence.draft_cache_length = min(sequence.draft_cache_length, len(sequence.token_ids) - 1)
        finished = sequence.finish_reason is not None
        if finished:
            self._release(sequence)
        text = sequence.detokenizer.take(final=finished) if (request.stream or finished) else ""
        return Update(sequence, text, finished)


def _log_prob(log_probs, position: int, token: int) -> float:
    """The emitted token's log-probability: from the engine's per-position values (greedy)
    or the target distribution it was drawn from (sampled; a recovered token's marginal is
    the target's, which rejection sampling preserves)."""
    if log_probs is None:
        return 0.0
    if isinstance(log_probs, torch.Tensor):
        return math.log(max(float(log_probs[position, token]), 1e-45))
    return float(log_probs[position])
