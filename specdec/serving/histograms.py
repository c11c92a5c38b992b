"""Latency and size histograms of the sequences the loop serves, kept in plain Python.

A Python-backend histogram (pb_utils) takes one observation per call, a round trip to the
server per row and token. Here an observation is a bisect and two additions; once per
iteration `take()` hands over what changed as increments of Prometheus's cumulative series
(<name>_bucket{le=...}, <name>_sum, <name>_count), which the BLS applies as counters
(serving/metrics.py): at most len(buckets) + 3 calls per histogram per iteration, however many
rows and tokens it observed.

What is observed (metric_names.py declares the families and their buckets):
- time to first token: arrival -> the commit of its first output token, once per sequence;
- queue time: arrival -> its KV slot, observed with its first token;
- inter-token latency, per output token after the first: an iteration that commits n tokens
  of a sequence spreads the time since its previous commit over them (n observations of
  gap / n); tokens committed in the same iteration as the first observe 0. A sequence's
  observations so sum to last_token_ns - first_token_ns, and count its output tokens - 1,
  whatever k and stream_interval;
- end-to-end latency and input / output tokens, once per sequence that finished normally.
No Triton here: the glue passes the sequences; the tests pass their own.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from specdec.loop.sequence import SequenceState
from specdec.serving.metric_names import (
    END_TO_END_LATENCY,
    HISTOGRAMS,
    INPUT_TOKENS,
    INTER_TOKEN_LATENCY,
    NORMAL_ENDS,
    OUTPUT_TOKENS,
    QUEUE_TIME,
    TIME_TO_FIRST_TOKEN,
)

NS = 1e-9  # seconds per nanosecond


@dataclass
class Increments:
    """What changed since the last take: per bucket (le order, +Inf last) the increase of its
    cumulative count, and of the sum and the count."""

    buckets: list[int]
    sum: float
    count: int


class BucketCounts:
    """One histogram's observations since the last take(), by bucket (le: value <= bound)."""

    def __init__(self, name: str, bounds: tuple[float, ...]) -> None:
        check_bounds(name, bounds)
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value` (one bisect whatever `times`)."""
        if times <= 0:
            return
        self._counts[bisect_left(self.bounds, value)] += times
        self._sum += value * times

    def take(self) -> Increments:
        """The increments of the cumulative series since the last take; starts afresh."""
        cumulative, running = [], 0
        for count in self._counts:
            running += count
            cumulative.append(running)
        taken = Increments(cumulative, self._sum, running)
        self._counts = [0] * len(self._counts)
        self._sum = 0.0
        return taken


def check_bounds(name: str, bounds: tuple[float, ...]) -> None:
    """A histogram's buckets: finite and strictly increasing (+Inf is implied)."""
    if not bounds:
        raise ValueError(f"{name}: buckets: none given")
    if not all(math.isfinite(bound) for bound in bounds):
        raise ValueError(f"{name}: buckets: {bounds} not all finite (+Inf is implied)")
    if any(low >= high for low, high in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"{name}: buckets: {bounds} not strictly increasing")


class SequenceHistograms:
    """The six histograms of metric_names.HISTOGRAMS, observed from the sequences' times."""

    def __init__(self) -> None:
        self.counts = {f.name: BucketCounts(f.name, f.buckets) for f in HISTOGRAMS}

    def tokens_committed(self, sequence: SequenceState, num_emitted: int) -> None:
        """An iteration committed `num_emitted` output tokens of `sequence` (times already
        stamped by the scheduler: first_token_ns, previous_token_ns, last_token_ns)."""
        if num_emitted <= 0:
            return
        times = sequence.times
        itl = self.counts[INTER_TOKEN_LATENCY]
        if sequence.num_output_tokens == num_emitted:  # its first tokens
            self.counts[TIME_TO_FIRST_TOKEN].observe((times.first_token_ns - times.arrival_ns) * NS)
            self.counts[QUEUE_TIME].observe((times.first_scheduled_ns - times.arrival_ns) * NS)
            itl.observe(0.0, num_emitted - 1)
        else:
            gap = (times.last_token_ns - times.previous_token_ns) * NS
            itl.observe(gap / num_emitted, num_emitted)

    def finished(self, sequence: SequenceState, now_ns: int) -> None:
        """`sequence` finished; its last response is built at `now_ns`. Only a normal end
        (end, length, stop) is observed."""
        if sequence.finish_reason not in NORMAL_ENDS:
            return
        self.counts[END_TO_END_LATENCY].observe((now_ns - sequence.times.arrival_ns) * NS)
        self.counts[INPUT_TOKENS].observe(len(sequence.request.prompt_ids))
        self.counts[OUTPUT_TOKENS].observe(sequence.num_output_tokens)

    def take(self) -> dict[str, Increments]:
        """Each histogram's increments since the last take (metrics.py applies them)."""
        return {name: counts.take() for name, counts in self.counts.items()}
