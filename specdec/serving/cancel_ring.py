"""Which requests the loop asks, each iteration, whether their streams were cancelled.

Asking crosses a process boundary (pb_utils `is_cancelled()`: what it costs is in
docs/operations.md), so the loop asks a
bounded number of waiting requests and a bounded number of running ones per iteration,
each round robin, and the cost grows neither with the queue nor with the batch
(serving/bls_model.py `_mark_cancelled`). Bound: with Q requests in a ring and `count`
taken per iteration, each is taken at least once every ceil(Q / count) iterations: the ones
ahead of it are either taken (and go behind it) or have left (and leave the ring without
being counted); newcomers join behind it.

Pure: the glue passes its request objects and what "still waiting" means.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class CancelRing(Generic[T]):
    """Requests in the order their turn comes; `waiting(request)` says whether one still
    waits (one that does not leaves the ring when its turn comes)."""

    def __init__(self, waiting: Callable[[T], bool]) -> None:
        self.waiting = waiting
        self._ring: collections.deque[T] = collections.deque()

    def __len__(self) -> int:
        return len(self._ring)

    def add(self, request: T) -> None:
        self._ring.append(request)

    def take(self, count: int) -> list[T]:
        """The next `count` waiting requests (fewer if fewer wait), each put back at the end.
        Each entry is looked at once at most per call; the ones that left the queue are
        dropped on the way (each once in its life, so the work stays bounded on average)."""
        ring = self._ring
        taken: list[T] = []
        for _ in range(len(ring)):
            if len(taken) == count:
                break
            request = ring.popleft()
            if self.waiting(request):
                taken.append(request)
                ring.append(request)
        return taken


class RunningTurns(Generic[T]):
    """The running requests' ring: a request joins when it is first seen running (`see`),
    and leaves once `live(request)` is false."""

    def __init__(self, live: Callable[[T], bool]) -> None:
        self._joined: set[int] = set()

        def live_or_leave(request: T) -> bool:
            if live(request):
                return True
            self._joined.discard(id(request))
            return False

        self._ring = CancelRing[T](live_or_leave)

    def __len__(self) -> int:
        return len(self._ring)

    def see(self, running: Iterable[T]) -> None:
        """Requests running now; the new ones join the ring, in this order."""
        for request in running:
            if id(request) not in self._joined:
                self._joined.add(id(request))
                self._ring.add(request)

    def take(self, count: int) -> list[T]:
        return self._ring.take(count)
