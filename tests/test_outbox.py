"""The outbox (specdec/serving/outbox.py): the loop's responses and metric updates, sent in
order on a thread beside the loop. Pure: fakes stand in for senders and metrics; the live
servers of the other tests run the real thing."""

from __future__ import annotations

import threading

import pytest

from specdec.serving.outbox import Outbox, PendingMetrics


@pytest.fixture
def outbox():
    errors: list[BaseException] = []
    box = Outbox(on_error=errors.append, threaded=True, max_pending=2)
    box.errors = errors
    yield box
    box.close(timeout=10)


def test_batches_run_in_order_beside_the_caller(outbox):
    released = threading.Event()
    sent: list[str] = []
    outbox.submit([released.wait, lambda: sent.append("a1"), lambda: sent.append("a2")])
    outbox.submit([lambda: sent.append("b1")])
    assert sent == []  # submit handed the work over: the caller goes on
    released.set()
    outbox.drain()
    assert sent == ["a1", "a2", "b1"]
    assert outbox.busy_seconds > 0


def test_a_full_backlog_makes_the_caller_wait(outbox):
    released = threading.Event()
    outbox.submit([released.wait])  # the thread is busy with this one
    outbox.submit([lambda: None])
    outbox.submit([lambda: None])  # the backlog of two is full now
    third = threading.Thread(target=outbox.submit, args=([lambda: None],))
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # waits for a free place
    released.set()
    third.join(timeout=10)
    assert not third.is_alive()
    outbox.drain()


def test_a_failed_send_is_reported_and_the_rest_still_go(outbox):
    sent: list[int] = []

    def fail():
        raise RuntimeError("stream closed")

    outbox.submit([lambda: sent.append(1), fail, lambda: sent.append(2)])
    outbox.submit([lambda: sent.append(3)])
    outbox.drain()
    assert sent == [1, 2, 3]
    assert [str(e) for e in outbox.errors] == ["stream closed"]


def test_close_runs_what_is_queued_then_runs_inline(outbox):
    sent: list[str] = []
    outbox.submit([lambda: sent.append("queued")])
    outbox.close(timeout=10)
    assert sent == ["queued"]
    caller = threading.get_ident()
    outbox.submit([lambda: sent.append("inline" if threading.get_ident() == caller else "x")])
    assert sent == ["queued", "inline"]
    outbox.submit([])  # nothing to do is fine, before and after close


class FakeMetric:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def increment(self, value: float) -> None:
        self.calls.append(("increment", value))

    def set(self, value: float) -> None:
        self.calls.append(("set", value))

    def observe(self, value: float) -> None:
        self.calls.append(("observe", value))


def test_pending_metrics_flush_one_call_per_counter_and_gauge():
    tokens, queued, histogram = FakeMetric(), FakeMetric(), FakeMetric()
    pending = PendingMetrics()
    pending.increment(tokens, 3)
    pending.increment(tokens, 0)  # nothing to add: no call
    pending.increment(tokens, 4)
    pending.set(queued, 9)
    pending.set(queued, 2)  # the last value wins
    for value in (1, 3, 1):
        pending.observe(histogram, value)
    pending.flush()
    assert tokens.calls == [("increment", 7)]
    assert queued.calls == [("set", 2)]
    assert histogram.calls == [("observe", 1), ("observe", 3), ("observe", 1)]
    pending.flush()  # flushed updates are not applied twice
    assert len(tokens.calls) == 1 and len(queued.calls) == 1 and len(histogram.calls) == 3


def test_pending_metrics_set_a_gauge_only_when_its_value_changed():
    running = FakeMetric()
    pending = PendingMetrics()
    for value in (4, 4, 5, 5, 4):  # one iteration each
        pending.set(running, value)
        pending.flush()
    assert running.calls == [("set", 4), ("set", 5), ("set", 4)]


def test_pending_metrics_take_unhashable_metrics():
    class Unhashable(FakeMetric):
        __hash__ = None

    metric = Unhashable()
    pending = PendingMetrics()
    pending.increment(metric, 1)
    pending.set(metric, 5)
    pending.flush()
    assert metric.calls == [("increment", 1), ("set", 5)]


def test_an_outbox_without_a_thread_runs_each_batch_at_once():
    errors: list[BaseException] = []
    box = Outbox(on_error=errors.append, threaded=False)
    caller, ran = threading.get_ident(), []
    box.submit([lambda: ran.append(threading.get_ident() == caller)])
    assert ran == [True]
    box.drain()  # nothing queued: returns
    box.close()
    assert errors == []
