"""Prometheus metrics of the speculative loop, on Triton's metrics port (/metrics).

Each update to a Triton metric is a round trip to the server process, so the recording
methods only gather updates (PendingMetrics); flush() applies them, called first in each
batch of the loop's outbox (serving/outbox.py), before that iteration's responses leave.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from specdec.loop.proposers import PROPOSERS
from specdec.loop.scheduler import IterationStats
from specdec.serving.metric_names import LOOP_PARTS, OUTBOX_SECONDS, OUTCOMES
from specdec.serving.outbox import PendingMetrics


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
        self.tokens_per_pass = family(
            "specdec_tokens_per_target_pass",
            "Tokens a sequence emits per target pass (accepted + 1)",
            pb_utils.MetricFamily.HISTOGRAM,
        ).Metric(labels=labels, buckets=[float(b) for b in range(1, max_k + 2)])

    def record_iteration(self, stats: IterationStats) -> None:
        pending = self.pending
        pending.increment(self.iterations, 1)
        pending.increment(self.draft_tokens, stats.num_draft_tokens)
        pending.increment(self.accepted_tokens, stats.num_accepted_draft_tokens)
        pending.increment(self.target_passes, len(stats.emitted_per_row))
        pending.increment(self.emitted_tokens, sum(stats.emitted_per_row))
        for emitted in stats.emitted_per_row:
            pending.observe(self.tokens_per_pass, emitted)
        pending.set(self.current_k, stats.chosen_k)
        for name, (proposed, accepted) in stats.by_proposer.items():
            pending.increment(self.proposer_tokens[name][0], proposed)
            pending.increment(self.proposer_tokens[name][1], accepted)

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

    def update_occupancy(self, num_running: int, num_waiting: int, free_slots: int) -> None:
        """After every step, also one that ran nothing (the last streams were cancelled)."""
        self.pending.set(self.batch_size, num_running)
        self.pending.set(self.queued, num_waiting)
        self.pending.set(self.free_slots, free_slots)

    def finished(self, outcome: str) -> None:
        self.pending.increment(self.requests[outcome], 1)

    def flush(self) -> None:
        """Applies the gathered updates (Triton round trips): on the outbox's thread."""
        self.pending.flush()
