"""Prometheus metrics of the speculative loop, on Triton's metrics port (/metrics).

Each update to a Triton metric is a round trip to the server process, so the recording
methods only gather updates (PendingMetrics); flush() applies them, called first in each
batch of the loop's outbox (serving/outbox.py), before that iteration's responses leave.
What one iteration records costs the same however many rows it ran: counters are summed
before they are applied, and the tokens each row emitted are counted by value (a pb_utils
histogram takes one observation per call, so there is none: one counter per value instead,
specdec_target_passes_by_tokens_total{tokens=...}). The latency histograms likewise: their
bucket counts gather in plain Python (serving/histograms.py) and go out once per iteration as
the counters of their cumulative series (<name>_bucket{le=...}, <name>_sum, <name>_count).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import triton_python_backend_utils as pb_utils

from specdec.loop.prefix_cache import PrefixCounts
from specdec.loop.proposers import REGISTRY
from specdec.loop.scheduler import IterationStats
from specdec.loop.sequence import SequenceState
from specdec.loop.suffix_store import StoreCounts
from specdec.serving.histograms import SequenceHistograms
from specdec.serving.metric_names import (
    CALIBRATED,
    ENGINE_CALL_KINDS,
    ENGINE_CALLS,
    ENGINE_RESULT_BYTES,
    FAMILIES,
    FAMILY_BY_NAME,
    HISTOGRAMS,
    LOOP_PARTS,
    OUTBOX_SECONDS,
    PASSES_BY_TOKENS,
    REQUEST_OUTCOMES,
    REQUESTS,
    SEQUENCE_OUTCOMES,
    SEQUENCES,
    Family,
    le_label,
)
from specdec.serving.outbox import PendingMetrics

# PrefixCounts field -> its running total's metric
PREFIX_COUNTERS = {
    "num_hits": "specdec_prefix_hits_total",
    "num_reused_tokens": "specdec_prefix_reused_tokens_total",
    "num_evictions": "specdec_prefix_evictions_total",
}


class LoopMetrics:
    def __init__(self, model: str, max_k: int, num_slots: int) -> None:
        self.model = model
        self.pending = PendingMetrics()
        # Every family of the table (metric_names.FAMILIES), a histogram's three series each
        # a counter family; a family must outlive its metrics.
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self.families = {
            series: pb_utils.MetricFamily(
                name=series, description=f.help, kind=gauge if f.kind == "gauge" else counter
            )
            for f in FAMILIES
            for series in f.series
        }
        metric = self._metric
        self.draft_tokens = metric("specdec_draft_tokens_total")
        self.accepted_tokens = metric("specdec_accepted_draft_tokens_total")
        self.target_passes = metric("specdec_target_passes_total")
        self.iterations = metric("specdec_iterations_total")
        self.emitted_tokens = metric("specdec_emitted_tokens_total")
        self.proposer_tokens = {
            name: (
                metric("specdec_proposer_draft_tokens_total", proposer=name),
                metric("specdec_proposer_accepted_draft_tokens_total", proposer=name),
            )
            for name in REGISTRY
        }
        self.requests = {o: metric(REQUESTS, outcome=o) for o in REQUEST_OUTCOMES}
        self.sequences = {o: metric(SEQUENCES, outcome=o) for o in SEQUENCE_OUTCOMES}
        self.batch_size = metric("specdec_running_batch_size")
        self.queued = metric("specdec_queued_requests")
        self.current_k = metric("specdec_current_num_draft_tokens")
        self.free_slots = metric("specdec_free_kv_slots")
        self.free_slots.set(num_slots)
        self.calibrated = metric(CALIBRATED)
        self.calibrated.set(0)
        self.outbox_seconds = metric(OUTBOX_SECONDS)
        self.outbox_seconds_flushed = 0.0
        self.loop_seconds = {
            part: metric("specdec_loop_seconds_total", part=part) for part in LOOP_PARTS
        }
        self.passes_by_tokens = [metric(PASSES_BY_TOKENS, tokens=str(n)) for n in range(max_k + 2)]
        self.engine_calls = {call: metric(ENGINE_CALLS, call=call) for call in ENGINE_CALL_KINDS}
        self.engine_result_bytes = {
            call: metric(ENGINE_RESULT_BYTES, call=call) for call in ENGINE_CALL_KINDS
        }
        # Prefix reuse across requests (specdec/loop/prefix_cache.py): running totals.
        self.prefix_counters = {field: metric(name) for field, name in PREFIX_COUNTERS.items()}
        self.prefix_flushed = PrefixCounts()
        self.cached_prefixes = metric("specdec_cached_prefixes")
        # The suffix proposer's store (specdec/loop/suffix_store.py): size now, evictions.
        self.suffix_bytes = metric("specdec_suffix_store_bytes")
        self.suffix_tokens = metric("specdec_suffix_store_tokens")
        self.suffix_evicted_tokens = metric("specdec_suffix_store_evicted_tokens_total")
        self.suffix_evictions = metric("specdec_suffix_store_evictions_total")
        self.suffix_flushed = StoreCounts()
        # Latency and size histograms: counted here, pushed by stage_histograms().
        self.histograms = SequenceHistograms()
        self.histogram_series = {f.name: self._histogram_series(f) for f in HISTOGRAMS}

    def _metric(self, name: str, series: str = "", **labels: str):
        """The metric of a family of the table with these labels (its label names, all); of
        a histogram, one of its series (`series`: "_bucket" with an le label, "_sum",
        "_count")."""
        declared = FAMILY_BY_NAME[name].labels + (("le",) if series == "_bucket" else ())
        if sorted(labels) != sorted(declared):
            raise ValueError(f"{name}: labels {sorted(labels)}, declared {sorted(declared)}")
        return self.families[name + series].Metric(labels={"model": self.model, **labels})

    def _histogram_series(self, family: Family) -> tuple[list[Any], Any, Any]:
        """A histogram's counters: its buckets in le order (+Inf last), its sum, its count."""
        metric = self._metric
        bounds = (*family.buckets, float("inf"))
        buckets = [metric(family.name, "_bucket", le=le_label(bound)) for bound in bounds]
        return buckets, metric(family.name, "_sum"), metric(family.name, "_count")

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

    def record_suffix_store(self, counts: StoreCounts) -> None:
        """The suffix store's size now and its evictions since start-up."""
        pending, flushed = self.pending, self.suffix_flushed
        pending.set(self.suffix_bytes, counts.num_bytes)
        pending.set(self.suffix_tokens, counts.num_tokens)
        evicted = counts.num_evicted_tokens - flushed.num_evicted_tokens
        pending.increment(self.suffix_evicted_tokens, evicted)
        pending.increment(
            self.suffix_evictions, counts.num_evicted_documents - flushed.num_evicted_documents
        )
        self.suffix_flushed = counts

    def update_occupancy(self, num_running: int, num_waiting: int, free_slots: int) -> None:
        """After every step, also one that ran nothing (the last streams were cancelled)."""
        self.pending.set(self.batch_size, num_running)
        self.pending.set(self.queued, num_waiting)
        self.pending.set(self.free_slots, free_slots)

    def request_ended(self, outcome: str) -> None:
        """A client request's final response is decided (REQUEST_OUTCOMES): once each."""
        self.pending.increment(self.requests[outcome], 1)

    def sequences_ended(self, outcome: str, count: int = 1) -> None:
        """`count` sequences ended with `outcome` (SEQUENCE_OUTCOMES)."""
        self.pending.increment(self.sequences[outcome], count)

    def tokens_committed(self, sequence: SequenceState, num_emitted: int) -> None:
        """The iteration committed `num_emitted` output tokens of a sequence still open."""
        self.histograms.tokens_committed(sequence, num_emitted)

    def sequence_finished(self, sequence: SequenceState, now_ns: int) -> None:
        """A sequence finished normally (end, length, stop): its last response is built."""
        self.histograms.finished(sequence, now_ns)

    def stage_histograms(self) -> None:
        """The histograms' increments since the last call, to the pending updates (once per
        iteration: at most a call per bucket, sum and count, whatever the rows)."""
        for name, taken in self.histograms.take().items():
            buckets, total, count = self.histogram_series[name]
            for metric, increment in zip(buckets, taken.buckets, strict=True):
                self.pending.increment(metric, increment)
            self.pending.increment(total, taken.sum)
            self.pending.increment(count, taken.count)

    def flush(self) -> None:
        """Applies the gathered updates (Triton round trips): on the outbox's thread."""
        self.pending.flush()
