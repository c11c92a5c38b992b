"""The KV cache slots, and prefixes reused across requests.

A sequence that ends leaves its target and draft caches in its slot. With the prefix cache on,
the free slot keeps an entry: the tokens whose keys and values it holds. A new request whose
prompt starts with at least `min_tokens` of those tokens, token for token, starts from them:

- from a free slot that holds them, it adopts the slot (nothing is copied);
- from a running sequence's slot, it takes a slot of its own and the engines copy the shared
  positions into it at its first call (as num_return_sequences' copies ride on that call).

Only the rest of its prompt is prefilled. The reused positions are exactly what a prefill
would have written, since a cache position depends only on the tokens before it.

A prefix is reused only by a request with the same `cache_salt` as the one that left it: the
salt is part of the index key, so tenants with their own salts never see each other's hits
(a hit shortens the time to first token, which would tell that another sent the same text).

Free slots are handed out lowest empty first, then by evicting the least recently used entry:
a cached prefix never makes a request wait. The index is bounded by the slots themselves (one
entry per free slot); a prompt is looked up by its first `min_tokens` tokens, so a lookup
compares only the entries that can match. Example, min_tokens 3:

    slot 5 free, holds [1, 2, 3, 4, 9]; a prompt [1, 2, 3, 4, 7, 8] adopts slot 5 with
    4 positions reused and prefills [7, 8] (its last token is always fed: it makes the
    first output token).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specdec.loop.sequence import SequenceState

DEFAULT_PREFIX_MIN_TOKENS = 64
PrefixKey = tuple[str, tuple[int, ...]]  # (cache_salt, the first min_tokens tokens)


@dataclass
class CachedPrefix:
    token_ids: np.ndarray  # (target positions,) int64: the tokens the slot's target cache holds
    draft_length: int  # of those, the positions the slot's draft cache holds
    key: PrefixKey  # the salt of the request that left it, and its first min_tokens tokens
    stamp: int  # when it was cached: a larger stamp is more recent


@dataclass
class PrefixMatch:
    slot: int  # the slot that holds the prefix
    length: int  # positions reused: the prompt's and the holder's common prefix
    draft_length: int  # of those, held by the draft cache too (cached entries only)
    source: SequenceState | None = None  # the running sequence that holds it (copy); None:
    # a free slot holds it (adopt)

    @property
    def running(self) -> bool:
        return self.source is not None


@dataclass
class PrefixCounts:
    """Since start-up, for metrics."""

    num_hits: int = 0  # requests that started from a reused prefix
    num_reused_tokens: int = 0  # prompt positions not prefilled thanks to it
    num_evictions: int = 0  # cached prefixes dropped to free their slot


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class SlotPool:
    """The free slots of both engines; with `min_tokens` set, the prefixes they still hold."""

    def __init__(self, num_slots: int, min_tokens: int | None) -> None:
        if min_tokens is not None and min_tokens < 1:
            raise ValueError(f"prefix_min_tokens: expected an integer >= 1, got {min_tokens}")
        self.min_tokens = min_tokens  # None: the prefix cache is off
        # A heap: the lowest empty slot first, so a batch's slots stay close together (the
        # engine's batched attention reads the slot range it spans).
        self.empty = list(range(num_slots))
        self.cached: collections.OrderedDict[int, CachedPrefix] = collections.OrderedDict()
        self.by_key: dict[PrefixKey, set[int]] = {}  # salt and first min_tokens -> cached slots
        self.counts = PrefixCounts()
        self._stamps = itertools.count()

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    def key(self, token_ids: Sequence[int], salt: str) -> PrefixKey | None:
        """The index key of a prefix: its salt and first min_tokens tokens (None: too short,
        or off). With the salt in the key, a lookup never even meets another salt's entries."""
        if self.min_tokens is None or len(token_ids) < self.min_tokens:
            return None
        return salt, tuple(token_ids[: self.min_tokens])

    # -- handing slots out and taking them back -----------------------------------------
    def take(self) -> int:
        """A free slot for a sequence that reuses nothing: the lowest empty one, else the
        least recently used cached one (its prefix is dropped)."""
        if self.empty:
            return heapq.heappop(self.empty)
        slot = next(iter(self.cached))
        self._drop(slot)
        self.counts.num_evictions += 1
        return slot

    def adopt(self, match: PrefixMatch) -> int:
        """The cached slot of `match`, taken with its contents."""
        self._drop(match.slot)
        self._count_hit(match)
        return match.slot

    def copied(self, match: PrefixMatch) -> None:
        """A running sequence's prefix was reused by a copy."""
        self._count_hit(match)

    def give_back(self, slot: int, token_ids: Sequence[int], draft_length: int, salt: str) -> None:
        """A slot whose sequence ended; `token_ids`: the tokens its target cache holds, `salt`:
        its request's cache_salt (only requests with the same one may reuse them)."""
        key = self.key(token_ids, salt)
        if key is None:
            heapq.heappush(self.empty, slot)
            return
        tokens = np.asarray(token_ids, dtype=np.int64)
        entry = CachedPrefix(tokens, min(draft_length, len(tokens)), key, next(self._stamps))
        self.cached[slot] = entry
        self.by_key.setdefault(key, set()).add(slot)

    def give_back_empty(self, slot: int) -> None:
        """A slot whose contents must not be reused (an engine failed)."""
        heapq.heappush(self.empty, slot)

    def forget_all(self) -> None:
        """Drops every cached prefix (the engines' caches can no longer be trusted)."""
        for slot in list(self.cached):
            self._drop(slot)
            heapq.heappush(self.empty, slot)

    # -- looking up -----------------------------------------------------------------------
    def find(
        self,
        prompt_ids: Sequence[int],
        salt: str,
        running: Iterable[tuple[int, Sequence[int], int, SequenceState]] = (),
    ) -> PrefixMatch | None:
        """The longest reusable prefix of a prompt with cache_salt `salt`, at least min_tokens
        long, in a free slot or in `running`: (slot, tokens, valid target positions, sequence)
        of sequences that may be copied from (those of another salt are passed over). The
        prompt's last token is never reused (it is fed to make the first output token). Ties
        go to a free slot (no copy), then to the most recently cached."""
        reusable = prompt_ids[:-1]
        key, min_tokens = self.key(reusable, salt), self.min_tokens
        if key is None or min_tokens is None:
            return None
        prompt = np.asarray(reusable, dtype=np.int64)
        best: PrefixMatch | None = None
        best_rank = (0, 0, 0)  # (length, 1 for a free slot, its stamp)
        for slot, tokens, valid, sequence in running:
            if sequence.request.cache_salt != salt:
                continue
            length = common_prefix_length(prompt, np.asarray(tokens[:valid], dtype=np.int64))
            if length >= min_tokens and (length, 0, 0) > best_rank:
                best, best_rank = PrefixMatch(slot, length, 0, sequence), (length, 0, 0)
        for slot in self.by_key.get(key, ()):
            entry = self.cached[slot]
            length = common_prefix_length(prompt, entry.token_ids)
            rank = (length, 1, entry.stamp)
            if length >= min_tokens and rank > best_rank:
                draft_length = min(entry.draft_length, length)
                best, best_rank = PrefixMatch(slot, length, draft_length), rank
        return best

    # -- internals ------------------------------------------------------------------------
    def _drop(self, slot: int) -> None:
        entry = self.cached.pop(slot)
        holders = self.by_key[entry.key]
        holders.discard(slot)
        if not holders:
            del self.by_key[entry.key]

    def _count_hit(self, match: PrefixMatch) -> None:
        self.counts.num_hits += 1
        self.counts.num_reused_tokens += match.length
