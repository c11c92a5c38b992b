"""What the loop sends each iteration: its responses and its metric updates, in order.

In Triton's Python backend every response sent and every metric updated is a round trip
to the server process (the stub waits for the server's answer), while the engines wait.
The loop builds each iteration's work and hands it to an Outbox, which runs it either at
once (`response_thread` false) or on a thread of its own while the loop runs the next step
(`response_thread` true). On 2 CPU cores the thread costs more than it saves: the server's
work on the responses then competes with the engine's threads (docs/benchmarks-archive.md,
"2026-12-02 (third run)"). It is for hosts whose engines run on a GPU, or that have cores
to spare: the BLS parameter's default, auto, turns it on with 4 or more usable cores
(serving/settings.py).

Order is kept: batches run in the order they were submitted, and the callables of a batch
in their order, so a request's responses arrive in order, its FINAL response last, and a
batch that starts with the metric flush makes a request counted before its final response
leaves. The backlog is bounded: submit() waits while `max_pending` batches are queued, so
a slow server side slows the loop instead of queueing without end.

No Triton import here: the glue (serving/bls_model.py) passes callables and metric
objects; the tests pass fakes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

Work = Callable[[], None]


class Outbox:
    """Runs batches of callables in submission order: at once on the caller's thread, or
    on a thread of its own (`threaded`)."""

    def __init__(
        self,
        on_error: Callable[[BaseException], None],
        threaded: bool = False,
        max_pending: int = 2,
        name: str = "outbox",
    ) -> None:
        self.on_error = on_error
        self.busy_seconds = 0.0  # time spent running work, read by the metrics
        self._queue: queue.Queue[list[Work] | None] = queue.Queue(maxsize=max_pending)
        self._inline = not threaded  # close() turns a threaded outbox inline
        self._state = threading.Lock()  # no batch may be queued behind close()'s sentinel
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def submit(self, batch: list[Work]) -> None:
        """Queues `batch` (waits while `max_pending` are queued); inline: runs it now."""
        if not batch:
            return
        with self._state:
            if not self._inline:
                self._queue.put(batch)  # may wait for the thread; it never takes _state
                return
        self._run_batch(batch)

    def drain(self) -> None:
        """Returns once every batch submitted so far has run."""
        self._queue.join()

    def close(self, timeout: float | None = None) -> None:
        """Runs what is queued, then stops the thread; later batches run inline."""
        with self._state:
            if self._inline:
                return
            self._inline = True
            self._queue.put(None)
        assert self._thread is not None  # not inline: threaded
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._run_batch(batch)
            finally:
                self._queue.task_done()

    def _run_batch(self, batch: list[Work]) -> None:
        started = time.perf_counter()
        for work in batch:
            try:
                work()
            except Exception as error:  # one failed send must not stop the others
                self.on_error(error)
        self.busy_seconds += time.perf_counter() - started


class Counter(Protocol):
    def increment(self, value: float) -> None: ...


class Gauge(Protocol):
    def set(self, value: float) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class PendingMetrics:
    """Metric updates gathered between flushes: counter increments summed, gauges' last
    values, histogram observations in order. flush() applies them to the metric objects
    (anything with increment / set / observe), one call per counter and gauge, and none for
    a gauge whose value it already set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the loop and execute() both record
        # Keyed by id(): the metric objects need not be hashable.
        self._increments: dict[int, tuple[Counter, float]] = {}  # id -> (metric, sum)
        self._values: dict[int, tuple[Gauge, float]] = {}  # id -> (metric, last value)
        self._observations: list[tuple[Histogram, float]] = []
        self._applied: dict[int, float] = {}  # id -> the gauge value flush() last set
        self._flushing = threading.Lock()  # inline, execute() and the loop may both flush

    def increment(self, metric: Counter, value: float) -> None:
        if value:
            with self._lock:
                _, total = self._increments.get(id(metric), (metric, 0.0))
                self._increments[id(metric)] = (metric, total + value)

    def set(self, metric: Gauge, value: float) -> None:
        with self._lock:
            self._values[id(metric)] = (metric, value)

    def observe(self, metric: Histogram, value: float) -> None:
        with self._lock:
            self._observations.append((metric, value))

    @property
    def num_pending(self) -> int:
        """Counters and gauges with an update gathered (at most one call each at flush)."""
        with self._lock:
            return len(self._increments) + len(self._values)

    def flush(self) -> None:
        with self._flushing:
            with self._lock:
                increments, self._increments = self._increments, {}
                values, self._values = self._values, {}
                observations, self._observations = self._observations, []
            for counter, total in increments.values():
                counter.increment(total)
            for key, (gauge, value) in values.items():
                if self._applied.get(key) != value:
                    gauge.set(value)
                    self._applied[key] = value
            for histogram, observed in observations:
                histogram.observe(observed)
