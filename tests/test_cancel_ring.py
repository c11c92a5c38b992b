"""The cancellation ring (specdec/serving/cancel_ring.py): a bounded number of waiting
requests per iteration, round robin, so asking costs the same however long the queue is, and
every waiting request is asked within ceil(Q / count) iterations."""

from __future__ import annotations

import math
import random

from specdec.serving.cancel_ring import CancelRing, RunningTurns


class Request:
    def __init__(self, name: int) -> None:
        self.name = name
        self.waiting = True


def ring_of(requests: list[Request]) -> CancelRing[Request]:
    ring = CancelRing[Request](lambda request: request.waiting)
    for request in requests:
        ring.add(request)
    return ring


def test_takes_count_per_call_round_robin():
    requests = [Request(i) for i in range(7)]
    ring = ring_of(requests)
    names = [[r.name for r in ring.take(3)] for _ in range(4)]
    assert names == [[0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]]


def test_requests_that_left_the_queue_are_dropped_without_counting():
    requests = [Request(i) for i in range(6)]
    ring = ring_of(requests)
    requests[0].waiting = requests[1].waiting = requests[4].waiting = False  # admitted, ended
    assert [r.name for r in ring.take(2)] == [2, 3]
    assert [r.name for r in ring.take(2)] == [5, 2]
    assert len(ring) == 3  # the three that left are gone for good
    for request in requests:
        request.waiting = False
    assert ring.take(2) == [] and len(ring) == 0


def test_fewer_waiting_than_count_takes_each_once():
    ring = ring_of([Request(i) for i in range(3)])
    assert [r.name for r in ring.take(16)] == [0, 1, 2]
    assert [r.name for r in ring.take(16)] == [0, 1, 2]


def test_every_waiting_request_is_taken_within_the_bound_while_the_queue_moves():
    """Requests join and leave at random between iterations; a request that waits is taken
    at least once in every ceil(Q / count) consecutive iterations, Q the number waiting
    when the stretch began (newcomers join behind it)."""
    rng = random.Random(0)
    count = 4
    waiting: list[Request] = [Request(i) for i in range(40)]
    ring = ring_of(waiting)
    last_taken = {r.name: 0 for r in waiting}  # iteration of the last take (0: joined)
    queue_at: dict[int, int] = {}  # iteration -> requests waiting before its take
    next_name = 40
    for iteration in range(1, 400):
        queue_at[iteration] = len(waiting)
        for request in ring.take(count):
            assert request.waiting
            last_taken[request.name] = iteration
        for request in waiting:  # nobody waits longer than the bound from its last take
            since = last_taken[request.name]
            bound = math.ceil(max(queue_at.get(since + 1, 1), 1) / count)
            assert iteration - since <= bound, (request.name, since, iteration)
        for request in rng.sample(waiting, k=min(len(waiting), rng.randint(0, 3))):
            request.waiting = False  # admitted or cancelled
            waiting.remove(request)
        for _ in range(rng.randint(0, 3)):
            request = Request(next_name)
            next_name += 1
            waiting.append(request)
            ring.add(request)
            last_taken[request.name] = iteration


# -- running requests (RunningTurns) ------------------------------------------------------
class Running:
    def __init__(self, name: int) -> None:
        self.name = name
        self.live = True


def test_running_requests_are_asked_count_per_iteration_each_within_the_bound():
    """64 running, 16 asked per iteration: each exactly once in every 4 iterations."""
    running = [Running(i) for i in range(64)]
    turns = RunningTurns[Running](lambda request: request.live)
    asked: list[list[int]] = []
    for _ in range(8):
        turns.see(running)  # the loop shows every running request each iteration
        asked.append([r.name for r in turns.take(16)])
    assert all(len(names) == 16 for names in asked)
    for start in range(0, 8, 4):
        window = sorted(n for names in asked[start : start + 4] for n in names)
        assert window == list(range(64))


def test_a_request_joins_once_behind_the_others_and_leaves_when_it_ends():
    running = [Running(i) for i in range(3)]
    turns = RunningTurns[Running](lambda request: request.live)
    turns.see(running)
    turns.see(running)  # seen again: not added twice
    assert len(turns) == 3
    newcomer = Running(3)
    turns.see([*running, newcomer])
    assert [r.name for r in turns.take(2)] == [0, 1]
    running[2].live = False  # finished or cancelled
    assert [r.name for r in turns.take(2)] == [3, 0]
    assert len(turns) == 3  # the ended one left the ring


def test_few_running_requests_are_all_asked_every_iteration():
    running = [Running(i) for i in range(5)]
    turns = RunningTurns[Running](lambda request: request.live)
    for _ in range(3):
        turns.see(running)
        assert sorted(r.name for r in turns.take(16)) == list(range(5))
