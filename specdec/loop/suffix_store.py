"""What followed each short context in earlier text: the suffix proposer's tables.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) proposes from suffix trees over earlier
outputs and the current prompt: it matches the newest tokens of a row, then follows the
continuation seen most often after that match, and proposes as far as the product of those
frequencies stays high. A suffix tree of depth D answers the same questions as counts of what
followed every context of 1..D tokens, which is what `SuffixIndex` keeps:

    text [7, 1, 2, 7, 1, 3, 7, 1, 2], depth 2: context (7, 1) was followed by 2 twice and
    by 3 once. A row ending in (..., 7, 1) walks 2 (frequency 2 / (3 + 1/2)), then context
    (1, 2), followed by 7 once (1 / (1 + 1/2)): the proposal [2, 7] with probabilities
    [0.57, 0.38].

`SuffixStore` is one index per cache salt over the text of every request (tenants apart: a
row reads only its own salt's index), bounded in bytes: documents (a request's text) are
evicted oldest first, their counts taken back out. Bytes are counted as the tables grow
(`BYTES_PER_*`, measured with tracemalloc by tests/test_suffix.py), so the bound costs no
scan.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_DEPTH = 8  # the longest context matched: a suffix tree's depth
# What the tables hold, in bytes of Python objects (CPython 3.11, 64-bit), an upper bound
# measured by tests/test_suffix.py: a context's table entry with its one follower, a further
# follower of a context, and a token a document keeps for its eviction.
BYTES_PER_CONTEXT = 260
BYTES_PER_FOLLOWER = 110
BYTES_PER_TOKEN = 10


class Followers:
    """The tokens that followed one context: how often each, and the most frequent. A
    context followed by one token only (the most common case) keeps no dict."""

    __slots__ = ("total", "best", "best_count", "counts")

    def __init__(self, token: int) -> None:
        self.total = 1
        self.best = token
        self.best_count = 1
        self.counts: dict[int, int] | None = None  # token -> count, from the 2nd follower

    def add(self, token: int) -> bool:
        """Counts one more `token`; True when it is a follower not seen before."""
        self.total += 1
        if self.counts is None:
            if token == self.best:
                self.best_count += 1
                return False
            self.counts = {self.best: self.best_count}
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        if count > self.best_count:
            self.best, self.best_count = token, count
        return count == 1

    def remove(self, token: int) -> bool:
        """Takes one `token` back out; True when it no longer follows at all."""
        self.total -= 1
        if self.counts is None:
            self.best_count -= 1
            return self.best_count == 0
        count = self.counts[token] - 1
        if count:
            self.counts[token] = count
        else:
            del self.counts[token]
        if token == self.best and self.counts:
            self.best, self.best_count = max(self.counts.items(), key=lambda kv: kv[1])
        return count == 0


@dataclass
class Continuation:
    """A walk's proposal: its tokens and, for each, the product of the frequencies so far."""

    token_ids: list[int] = field(default_factory=list)
    probabilities: list[float] = field(default_factory=list)  # falling, in (0, 1]
    match_length: int = 0  # tokens of the row's tail the walk started from (0: none)

    @property
    def expected_tokens(self) -> float:
        """Tokens a verify would accept if the frequencies were the acceptance rates."""
        return sum(self.probabilities)


def frequency(followers: Followers, context_length: int) -> float:
    """How often the most frequent follower came after a context of `context_length` tokens,
    with 1 / context_length pseudo-counts against it: a longer context is a surer guess. Seen
    once after one token: 0.5; once after 8 tokens: 0.89; ten times after one token: 0.91."""
    return followers.best_count / (followers.total + 1 / context_length)


class SuffixIndex:
    """Counts of what followed every context of 1..depth tokens in some texts."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        self.depth = depth
        self.table: dict[tuple[int, ...], Followers] = {}
        self.num_followers = 0  # (context, token) pairs: the table's size beside len(table)

    def add(self, text: Sequence[int], end: int) -> None:
        """Counts text[end] after each context of up to `depth` tokens ending before it."""
        token = text[end]
        table = self.table
        for n in range(1, min(self.depth, end) + 1):
            context = tuple(text[end - n : end])
            followers = table.get(context)
            if followers is None:
                table[context] = Followers(token)
                self.num_followers += 1
            elif followers.add(token):
                self.num_followers += 1

    def add_from(self, text: Sequence[int], start: int) -> None:
        """add(text, end) for every end from `start` (at least 1) to the text's end."""
        for end in range(max(start, 1), len(text)):
            self.add(text, end)

    def remove(self, text: Sequence[int], end: int) -> None:
        """Takes back what add(text, end) counted."""
        token = text[end]
        table = self.table
        for n in range(1, min(self.depth, end) + 1):
            context = tuple(text[end - n : end])
            if table[context].remove(token):
                self.num_followers -= 1
                if table[context].total == 0:
                    del table[context]

    def walk(self, tail: Sequence[int], max_tokens: int, min_probability: float) -> Continuation:
        """Up to `max_tokens` tokens after `tail`: from its longest context with followers,
        the most frequent follower, again and again, while the product of their frequencies
        stays at least `min_probability`."""
        result = Continuation()
        if max_tokens <= 0:
            return result
        context = list(tail[-self.depth :])
        followers, length = self._longest(context)
        result.match_length = length
        probability = 1.0
        while followers is not None and len(result.token_ids) < max_tokens:
            probability *= frequency(followers, length)
            if probability < min_probability:
                break
            result.token_ids.append(followers.best)
            result.probabilities.append(probability)
            context.append(followers.best)
            if len(context) > self.depth:
                del context[0]
            followers, length = self._longest(context)
        return result

    def _longest(self, context: list[int]) -> tuple[Followers | None, int]:
        table = self.table
        for n in range(len(context), 0, -1):
            followers = table.get(tuple(context[-n:]))
            if followers is not None:
                return followers, n
        return None, 0


@dataclass
class Document:
    """One request's text in the store, in order of arrival (the oldest is evicted first)."""

    salt: str
    token_ids: list[int]  # its text: the context it opened with, then what it fed
    first_counted: int  # positions before this are context only (not counted as followers)
    evicted: bool = False


@dataclass
class StoreCounts:
    """The store's size now, and what it evicted since start-up (for metrics)."""

    num_bytes: int = 0  # as counted (BYTES_PER_*)
    num_tokens: int = 0  # tokens its documents hold
    num_documents: int = 0
    num_evicted_documents: int = 0
    num_evicted_tokens: int = 0


def table_bytes(num_contexts: int, num_followers: int) -> int:
    """What tables of this size hold (each context has one follower at least)."""
    return num_contexts * BYTES_PER_CONTEXT + (num_followers - num_contexts) * BYTES_PER_FOLLOWER


class SuffixStore:
    """One SuffixIndex per cache salt over every request's text, within `max_bytes`."""

    def __init__(self, max_bytes: int, depth: int = DEFAULT_DEPTH) -> None:
        self.max_bytes = max_bytes
        self.depth = depth
        self.indexes: dict[str, SuffixIndex] = {}
        self.documents: collections.deque[Document] = collections.deque()
        self.counts = StoreCounts()

    def open(self, salt: str, context: Sequence[int]) -> Document:
        """A new document that starts after `context` (its last `depth` tokens are kept, so
        that what follows is counted after them; they are not counted themselves)."""
        kept = list(context[-self.depth :])
        document = Document(salt, kept, first_counted=len(kept))
        self.documents.append(document)
        self.counts.num_documents += 1
        self._resize(len(kept), 0, 0)
        return document

    def extend(self, document: Document, token_ids: Sequence[int]) -> Document:
        """Counts `token_ids` after the document's text, then evicts the oldest documents
        past the bound; returns the document that holds them (a new one, opened with the old
        one's last tokens as context, where the old one was evicted meanwhile)."""
        if not token_ids:
            return document
        if document.evicted:
            document = self.open(document.salt, document.token_ids)
        index = self.indexes.get(document.salt)
        if index is None:
            index = self.indexes[document.salt] = SuffixIndex(self.depth)
        contexts, followers = len(index.table), index.num_followers
        text = document.token_ids
        text.extend(token_ids)
        index.add_from(text, len(text) - len(token_ids))
        self._resize(len(token_ids), len(index.table) - contexts, index.num_followers - followers)
        self._evict()
        return document

    def walk(
        self, salt: str, tail: Sequence[int], max_tokens: int, min_probability: float
    ) -> Continuation:
        """SuffixIndex.walk over the salt's text only."""
        index = self.indexes.get(salt)
        if index is None:
            return Continuation()
        return index.walk(tail, max_tokens, min_probability)

    def _resize(self, tokens: int, contexts: int, followers: int) -> None:
        self.counts.num_tokens += tokens
        self.counts.num_bytes += tokens * BYTES_PER_TOKEN + table_bytes(contexts, followers)

    def _evict(self) -> None:
        """The oldest documents out until the store is within its bound (the newest stays,
        even alone over it: the running rows propose from it)."""
        while self.counts.num_bytes > self.max_bytes and len(self.documents) > 1:
            self._drop(self.documents.popleft())

    def _drop(self, document: Document) -> None:
        text = document.token_ids
        index = self.indexes.get(document.salt)
        if index is not None:
            contexts, followers = len(index.table), index.num_followers
            for end in range(document.first_counted, len(text)):
                index.remove(text, end)
            self._resize(0, len(index.table) - contexts, index.num_followers - followers)
            if not index.table:
                del self.indexes[document.salt]
        self._resize(-len(text), 0, 0)
        counts = self.counts
        counts.num_documents -= 1
        counts.num_evicted_documents += 1
        counts.num_evicted_tokens += len(text)
        document.evicted = True
