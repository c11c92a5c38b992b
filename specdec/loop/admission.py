"""Admission: the waiting queue, the KV cache slots, and the prompt caches copied between them.

Sequences join the running batch at step boundaries while slots are free and leave when
done; the caches of both engines are addressed by the sequence's slot. The sequences that
one prompt asks for (num_return_sequences) share its prompt cache: the first fills it, the
others copy it into their slots at their first step instead of computing it again. Other
requests whose prompts start with a cached or running sequence's tokens start from those
(specdec/loop/prefix_cache.py), when both requests carry the same cache_salt.
"""

from __future__ import annotations

import collections
import itertools
import secrets
from collections.abc import Callable

from specdec.loop.prefix_cache import PrefixKey, PrefixMatch, SlotPool
from specdec.loop.sequence import CacheCopy, SequenceState
from specdec.text.detokenizer import Decode, IncrementalDetokenizer
from specdec.text.request import GenerationRequest


class QueueFull(RuntimeError):
    pass


class Admission:
    def __init__(
        self,
        num_slots: int,
        max_queue: int,
        decode: Decode,
        clock: Callable[[], int],
        prefix_min_tokens: int | None = None,  # None: no prefix reuse across requests
    ) -> None:
        self.max_queue = max_queue
        self.decode = decode
        self.clock = clock  # for SequenceTimes
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []
        self.slots = SlotPool(num_slots, prefix_min_tokens)
        # Running sequences whose prompts may be copied from, by their first tokens.
        self.running_by_key: dict[PrefixKey, set[SequenceState]] = {}
        self._ids = itertools.count()
        self.num_cancelled_waiting = 0  # cancelled sequences still in self.waiting

    # -- joining -------------------------------------------------------------------------
    def submit_all(self, requests: list[GenerationRequest]) -> list[SequenceState]:
        """Queues every sequence of one client request (each prompt's num_return_sequences,
        in order), all or none."""
        count = sum(r.num_return_sequences for r in requests)
        # Requests that will get a free slot at the next step are not queued behind anyone.
        if len(self.waiting) + count > self.max_queue + self.slots.num_free:
            raise QueueFull(f"queue full ({self.max_queue} requests waiting for a slot)")
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

    def _new_sequence(
        self, request: GenerationRequest, index: int, parent: SequenceState | None
    ) -> SequenceState:
        if request.seed is None:
            seed = secrets.randbits(63)
        else:  # the request's seed for its first sequence; the others get their own
            seed = (request.seed + index * 0x9E3779B97F4A7C15) % 2**63
        return SequenceState(
            request=request,
            detokenizer=IncrementalDetokenizer(self.decode, request.stop_words),
            seed=seed,
            id=next(self._ids),
            token_ids=list(request.prompt_ids),
            sequence_index=index,
            parent=parent,
        )

    def admit(self) -> int:
        """Moves waiting sequences into free slots; returns how many joined."""
        admitted = 0
        now = self.clock()
        while self.waiting and self.slots.num_free:
            sequence = self.waiting.popleft()
            if sequence.cancelled:
                continue
            self._place(sequence)
            sequence.times.first_scheduled_ns = now
            self.running.append(sequence)
            admitted += 1
        return admitted

    def _place(self, sequence: SequenceState) -> None:
        """Gives the sequence its slot, and what it starts from: its parent's prompt cache,
        a cached prefix it adopts, a running sequence's prefix it copies, or nothing."""
        parent = sequence.parent
        prompt_ids = sequence.request.prompt_ids
        # The parent's slot holds the prompt (once prefilled) for as long as it runs.
        if parent is not None and parent.slot >= 0 and len(sequence.token_ids) > 1:
            sequence.slot = self.slots.take()
            sequence.copy_source_slot, sequence.copy_from = parent.slot, parent
            sequence.copy_length = len(prompt_ids) - 1  # the last prompt token is fed
            return
        salt = sequence.request.cache_salt
        key = self.slots.key(prompt_ids[:-1], salt)  # the prompt's last token is always fed
        match = None if key is None else self._find_prefix(prompt_ids, salt, key)
        if match is None:
            sequence.slot = self.slots.take()
        elif match.running:
            sequence.slot = self.slots.take()
            sequence.copy_source_slot, sequence.copy_from = match.slot, match.source
            sequence.copy_length = match.length
            self.slots.copied(match)
        else:
            sequence.slot = self.slots.adopt(match)
            sequence.start_from(match.length, match.draft_length)
        if key is not None:
            self.running_by_key.setdefault(key, set()).add(sequence)

    def _find_prefix(self, prompt_ids: list[int], salt: str, key: PrefixKey) -> PrefixMatch | None:
        holders = self.running_by_key.get(key, ())
        running = [(s.slot, s.token_ids, s.target_cache_length, s) for s in holders]
        return self.slots.find(prompt_ids, salt, running)

    @staticmethod
    def ready(sequence: SequenceState) -> bool:
        """False while the sequence waits for its parent's prefill to copy it."""
        source = sequence.copy_from
        if sequence.copy_source_slot < 0 or source is None or source is not sequence.parent:
            return True  # nothing to copy, or a running sequence's positions, there now
        if source.stats.num_target_passes:
            return True
        if source.slot < 0 or source.cancelled:  # nothing to copy after all: prefill
            sequence.copy_source_slot, sequence.copy_from = -1, None
            return True
        return False

    @staticmethod
    def plan_copies(
        batch: list[SequenceState], copy_draft: bool
    ) -> tuple[list[CacheCopy], list[CacheCopy]]:
        """(target copies, draft copies) for the rows that start from another sequence's
        cache (their parent's prompt, or a running sequence's prefix); sets their cache
        lengths to match. The draft's copy rides on this step's draft call (`copy_draft`);
        without one the draft catches up."""
        target_copies, draft_copies = [], []
        for sequence in batch:
            source = sequence.copy_from
            if sequence.copy_source_slot < 0 or source is None:
                continue
            length = sequence.copy_length
            target_copies.append((sequence.copy_source_slot, sequence.slot, length))
            draft_length: int | None = min(source.draft_cache_length, length)
            if copy_draft and draft_length:
                draft_copies.append((sequence.copy_source_slot, sequence.slot, draft_length))
            else:
                draft_length = None  # the draft catches up instead
            sequence.start_from(length, draft_length)
            sequence.copy_source_slot, sequence.copy_from = -1, None
        return target_copies, draft_copies

    # -- leaving -------------------------------------------------------------------------
    def release(self, sequence: SequenceState, reusable: bool = True) -> None:
        """Frees the sequence's slot. Its caches' contents stay until the slot is reused;
        with the prefix cache on and `reusable`, later prompts may start from them."""
        if sequence.slot < 0:
            return
        salt = sequence.request.cache_salt
        key = self.slots.key(sequence.request.prompt_ids[:-1], salt)
        holders = self.running_by_key.get(key, set()) if key is not None else set()
        holders.discard(sequence)
        if key is not None and not holders:
            self.running_by_key.pop(key, None)
        if reusable:
            held = sequence.token_ids[: sequence.target_cache_length]
            self.slots.give_back(sequence.slot, held, sequence.draft_cache_length, salt)
        else:
            self.slots.give_back_empty(sequence.slot)
        sequence.slot = -1

    def cancel(self, sequence: SequenceState) -> None:
        """Marks the sequence cancelled; the next drop_cancelled ends it."""
        if not sequence.cancelled and sequence.slot < 0 and not sequence.finished:
            self.num_cancelled_waiting += 1
        sequence.cancelled = True

    def drop_cancelled(self) -> list[SequenceState]:
        """Ends the cancelled running sequences and returns them; drops the cancelled waiting
        ones (they never ran: the glue answers them). The queue is rebuilt only when one of
        its sequences was cancelled: a step's cost does not grow with the queue."""
        cancelled = [s for s in self.running if s.cancelled]
        for sequence in cancelled:
            sequence.finish_reason = "cancelled"
            self.release(sequence)
        if cancelled:
            self.running = [s for s in self.running if not s.cancelled]
        if self.num_cancelled_waiting:
            self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
            self.num_cancelled_waiting = 0
        return cancelled

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def end_all(self, reason: str) -> list[SequenceState]:
        """Ends every sequence, running or waiting; returns them."""
        ended = list(self.running) + list(self.waiting)
        for sequence in ended:
            sequence.finish_reason = reason
            self.release(sequence, reusable=False)
        self.slots.forget_all()  # after a failure the engines' caches are not to be trusted
        self.running, self.waiting = [], collections.deque()
        self.num_cancelled_waiting = 0
        return ended
