"""Prometheus metrics of the speculative loop, on Triton's metrics port (/metrics).

Each update to a Triton metric is a round trip to the server process, so the recording
methods only gather updates (PendingMetrics); flush() applies them, called first in each
batch of the loop's outbox (serving/outbox.py), before that iteration's responses leave.
What one iteration records costs the same however many rows it ran: counters are summed
before they are applied, and the tokens each row emitted are counted by value (a pb_utils
histogram takes one observation per call, so there is none: one counter per value instead,
specdec_target_passes_by_tokens_total{tokens=...}).
"""

from __future__ import annotations

from collections import Counter

import triton_python_backend_utils as pb_utils

from specdec.loop.prefix_cache import PrefixCounts
from specdec.loop.proposers import PROPOSERS
from specdec.loop.scheduler import IterationStats
from specdec.serving.metric_names import (
    CALIBRATED,
    ENGINE_CALL_KINDS,
    ENGINE_CALLS,
    ENGINE_RESULT_BYTES,
    LOOP_PARTS,
    OUTBOX_SECONDS,
    OUTCOMES,
    PASSES_BY_TOKENS,
)
from specdec.serving.outbox import PendingMetrics

# PrefixCounts field -> (metric name, help)
PREFIX_COUNTERS = (
    ("num_hits", "specdec_prefix_hits_total", "Requests that started from a reused prefix"),
    (
        "num_reused_tokens",
        "specdec_prefix_reused_tokens_total",
        "Prompt positions reused from a cached or running sequence instead of prefilled",
    ),
    (
        "num_evictions",
        "specdec_prefix_evictions_total",
        "Cached prefixes dropped to give their slot to a new sequence",
    ),
)


class LoopMetrics:
    def __init__(self, model: str, max_k: int, num_slots: int) -> None:
        labels = {"model": model}
        self.pending = PendingMetrics()
        self.families: list[object] = []  # a family must outlive its metrics

        def family(name, description, kind):
            created = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self.families.append(created)
            return created

        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.draft_tokens = family(
            "specdec_draft_tokens_total", "Draft tokens proposed", counter
        ).Metric(labels=labels)
        self.accepted_tokens = family(
            "specdec_accepted_draft_tokens_total", "Draft tokens accepted by the target", counter
        ).Metric(labels=labels)
        self.target_passes = family(
            "specdec_target_passes_total",
            "Sequences verified by the target (one per sequence per iteration)",
            counter,
        ).Metric(labels=labels)
        self.iterations = family(
            "specdec_iterations_total", "Loop iterations (one target call each)", counter
        ).Metric(labels=labels)
        self.emitted_tokens = family(
            "specdec_emitted_tokens_total", "Output tokens emitted", counter
        ).Metric(labels=labels)
        by_proposer = family(
            "specdec_proposer_draft_tokens_total", "Draft tokens proposed, by proposer", counter
        )
        accepted_by_proposer = family(
            "specdec_proposer_accepted_draft_tokens_total",
            "Draft tokens accepted by the target, by proposer",
            counter,
        )
        self.proposer_tokens = {
            name: (
                by_proposer.Metric(labels={**labels, "proposer": name}),
                accepted_by_proposer.Metric(labels={**labels, "proposer": name}),
            )
            for name in PROPOSERS
        }
        requests = family("specdec_requests_total", "Finished requests by outcome", counter)
        self.requests = {o: requests.Metric(labels={**labels, "outcome": o}) for o in OUTCOMES}
        self.batch_size = family(
            "specdec_running_batch_size", "Sequences in the running batch", gauge
        ).Metric(labels=labels)
        self.queued = family(
            "specdec_queued_requests", "Requests waiting for a KV slot", gauge
        ).Metric(labels=labels)
        self.current_k = family(
            "specdec_current_num_draft_tokens", "k the controller chose for adaptive rows", gauge
        ).Metric(labels=labels)
        self.free_slots = family(
            "specdec_free_kv_slots", "KV cache slots free in each engine", gauge
        ).Metric(labels=labels)
        self.free_slots.set(num_slots)
        self.calibrated = family(
            CALIBRATED,
            "1 once the start-up measurement of the engines' costs is over; requests wait "
            "until then",
            gauge,
        ).Metric(labels=labels)
        self.calibrated.set(0)
        self.outbox_seconds = family(
            OUTBOX_SECONDS,
            "Seconds the outbox spent sending responses and applying metric updates (inline: "
            "within the loop's respond part; with response_thread: beside the loop)",
            counter,
        ).Metric(labels=labels)
        self.outbox_seconds_flushed = 0.0
        loop_seconds = family(
            "specdec_loop_seconds_total",
            "Seconds the loop spent, by part (" + ", ".join(LOOP_PARTS) + ")",
            counter,
        )
        self.loop_seconds = {
            part: loop_seconds.Metric(labels={**labels, "part": part}) for part in LOOP_PARTS
        }
        passes_by_tokens = family(
            PASSES_BY_TOKENS,
            "Target passes by the tokens the sequence emitted in them (accepted + 1)",
            counter,
        )
        self.passes_by_tokens = [
            passes_by_tokens.Metric(labels={**labels, "tokens": str(n)}) for n in range(max_k + 2)
        ]
        engine_calls = family(ENGINE_CALLS, "Engine model calls by the loop", counter)
        result_bytes = family(
            ENGINE_RESULT_BYTES, "Bytes the engine calls' results brought back", counter
        )
        self.engine_calls = {
            call: engine_calls.Metric(labels={**labels, "call": call}) for call in ENGINE_CALL_KINDS
        }
        self.engine_result_bytes = {
            call: result_bytes.Metric(labels={**labels, "call": call}) for call in ENGINE_CALL_KINDS
        }
        # Prefix reuse across requests (specdec/loop/prefix_cache.py): running totals.
        self.prefix_counters = {
            name: family(metric, text, counter).Metric(labels=labels)
            for name, metric, text in PREFIX_COUNTERS
        }
        self.prefix_flushed = PrefixCounts()
        self.cached_prefixes = family(
            "specdec_cached_prefixes", "Free KV slots that hold a reusable prefix", gauge
        ).Metric(labels=labels)

    def record_iteration(self, stats: IterationStats) -> None:
        """An iteration that ran (one target call): a fixed number of updates, not one per
        row."""
        pending = self.pending
        pending.increment(self.iterations, 1)
        pending.increment(self.draft_tokens, stats.num_draft_tokens)
        pending.increment(self.accepted_tokens, stats.num_accepted_draft_tokens)
        pending.increment(self.target_passes, len(stats.emitted_per_row))
        pending.increment(self.emitted_tokens, sum(stats.emitted_per_row))
        top = len(self.passes_by_tokens) - 1
        for emitted, rows in Counter(stats.emitted_per_row).items():
            pending.increment(self.passes_by_tokens[min(emitted, top)], rows)
        pending.set(self.current_k, stats.chosen_k)
        for name, (proposed, accepted) in stats.by_proposer.items():
            pending.increment(self.proposer_tokens[name][0], proposed)
            pending.increment(self.proposer_tokens[name][1], accepted)
        pending.increment(self.engine_calls["draft"], stats.num_draft_calls)
        pending.increment(self.engine_calls["target"], 1)
        pending.increment(self.engine_result_bytes["draft"], stats.draft_result_bytes)
        pending.increment(self.engine_result_bytes["target"], stats.target_result_bytes)

    def record_loop_seconds(
        self, cancel_check: float, step: float, respond: float, iteration: IterationStats | None
    ) -> None:
        """One iteration's time by part; the step splits into its engine calls and the rest."""
        draft = target = 0.0
        if iteration is not None:
            draft, target = iteration.draft_seconds, iteration.target_seconds
        seconds = {
            "cancel_check": cancel_check,
            "draft": draft,
            "target": target,
            "schedule": max(0.0, step - draft - target),
            "respond": respond,
        }
        for part, value in seconds.items():
            self.pending.increment(self.loop_seconds[part], value)

    def record_hand_over_seconds(self, seconds: float) -> None:
        """The loop's time handing an iteration to the outbox (inline: sending it), which
        the respond part includes."""
        self.pending.increment(self.loop_seconds["respond"], seconds)

    def record_outbox_seconds(self, total: float) -> None:
        """The outbox's running total of busy seconds (Outbox.busy_seconds)."""
        self.pending.increment(self.outbox_seconds, total - self.outbox_seconds_flushed)
        self.outbox_seconds_flushed = total

    def record_prefix_counts(self, counts: PrefixCounts, num_cached: int) -> None:
        """The prefix cache's totals since start-up (increments since the last call go out)."""
        for name, metric in self.prefix_counters.items():
            total = getattr(counts, name)
            self.pending.increment(metric, total - getattr(self.prefix_flushed, name))
            setattr(self.prefix_flushed, name, total)
        self.pending.set(self.cached_prefixes, num_cached)

    def update_occupancy(self, num_running: int, num_waiting: int, free_slots: int) -> None:
        """After every step, also one that ran nothing (the last streams were cancelled)."""
        self.pending.set(self.batch_size, num_running)
        self.pending.set(self.queued, num_waiting)
        self.pending.set(self.free_slots, free_slots)

    def finished(self, outcome: str, count: int = 1) -> None:
        """`count` requests (or sequences) ended with `outcome`."""
        self.pending.increment(self.requests[outcome], count)

    def flush(self) -> None:
        """Applies the gathered updates (Triton round trips): on the outbox's thread."""
        self.pending.flush()
