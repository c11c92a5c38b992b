"""Which request a load stream sends next: a walk through a workload's prompts.

A workload is either a list of requests, each a list of chat messages (chat, grounded,
rewrite: one user message; shared-prefix: one system text, then a question; structured: a
request and the guide its answer must follow, loadtest/structured.py), or a list of
conversations (multi-turn: user turns). A walk hands out the messages of the next request
and hears the answer the server gave, so that a conversation's next request resends the
whole history with the answers this stream received:

    turns ["Write a notice.", "Make it shorter."], answers "Notice: ..." and "Short: ..."
    request 1: [user "Write a notice."]
    request 2: [user "Write a notice.", assistant "Notice: ...", user "Make it shorter."]
    request 3: the next conversation's first turn

Rendered with the model's chat template, request t + 1 starts with request t's prompt and
its answer, text for text: the server can reuse that sequence's cache (its prefix cache).
No server, no tokenizer here: bench.py and the locustfile render the messages their way.

A unique workload (agentic: tasks without end, loadtest/agentic.py) is cut into parts of
PART_SIZE tasks; a walk given a part takes its tasks from that part alone, so walks given
different parts never send the same prompt. The other workloads ignore the part: every
walk of stream i of c sends the same sequence.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from structured import Guide

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}
# A unique workload's tasks per part: more than any walk takes (stream i of c takes tasks
# i, i + c, i + 2c, ... of its part), so no walk runs into the next part.
PART_SIZE = 2**32


class Walk(Protocol):
    def next_request(self) -> list[Message]:
        """The messages of the request to send now."""
        ...

    def answered(self, answer: str | None) -> None:
        """What the server answered to the last request; None: it failed."""
        ...

    def guide(self) -> Guide | None:
        """The guided decoding of the last request (None: free text)."""
        ...


def strided(start: int, step: int, count: int) -> Iterator[int]:
    """start, start + step, start + 2 step, ... modulo count: stream `start` of `step`."""
    return ((start + n * step) % count for n in itertools.count())


def shuffled(rng: random.Random, count: int) -> Iterator[int]:
    """Indices drawn at random, forever (Locust's users)."""
    return (rng.randrange(count) for _ in itertools.count())


@dataclass
class ListWalk:
    """One request after another, in `order`; answers change nothing."""

    requests: list[list[Message]]
    order: Iterator[int]
    guides: Sequence[Guide] = ()  # each request's (structured); none: free text
    last: int = -1  # the index of the last request

    def next_request(self) -> list[Message]:
        self.last = next(self.order)
        return self.requests[self.last]

    def answered(self, answer: str | None) -> None:
        pass

    def guide(self) -> Guide | None:
        return self.guides[self.last] if self.guides else None


@dataclass
class ConversationWalk:
    """Conversations in `order`, each turn by turn: a request is the history so far (the
    earlier user turns and the answers to them) and the next user turn. After the last turn,
    or a failed request (no answer to keep), the next request opens the next conversation,
    after `head` (a system message, worked examples) where there is one."""

    conversations: Sequence[list[str]]  # each: its user turns
    order: Iterator[int]
    head: list[Message] = field(default_factory=list)  # what every conversation opens with
    history: list[Message] = field(default_factory=list)  # the conversation's so far
    turns: list[str] = field(default_factory=list)  # the user turns still to come
    sent: list[Message] | None = None  # the request awaiting its answer

    def next_request(self) -> list[Message]:
        if not self.turns:
            self.history = list(self.head)
            self.turns = list(self.conversations[next(self.order)])
        self.sent = [*self.history, {"role": "user", "content": self.turns.pop(0)}]
        return self.sent

    def answered(self, answer: str | None) -> None:
        if self.sent is None:
            raise RuntimeError("an answer without a request")
        if answer is None:
            self.turns = []  # abandon the conversation
        else:
            self.history = [*self.sent, {"role": "assistant", "content": answer}]
        self.sent = None

    def guide(self) -> Guide | None:
        return None


@dataclass
class Workload:
    """A workload's requests or conversations, and a walk per stream over them."""

    name: str
    requests: list[list[Message]] = field(default_factory=list)  # list workloads
    guides: Sequence[Guide] = ()  # each request's guided decoding (structured); none: free text
    conversations: Sequence[list[str]] = field(default_factory=list)  # multi-turn, agentic
    head: list[Message] = field(default_factory=list)  # the conversations' opening messages
    # True: walks given different parts take different tasks (agentic: no prompt is sent
    # twice in a run); False: the part changes nothing.
    unique: bool = False
    # The room every answer needs (structured: its answers are checked, and a cut one would
    # count as cut); a load asks for at least this many tokens. None: the load's own.
    min_max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.guides and len(self.guides) != len(self.requests):
            raise ValueError("a guide for each request, or none")

    def walk(self, order: Callable[[int], Iterator[int]]) -> Walk:
        """A fresh walk; `order(count)` gives the indices it takes."""
        if self.conversations:
            count = len(self.conversations)
            return ConversationWalk(self.conversations, order(count), self.head)
        return ListWalk(self.requests, order(len(self.requests)), self.guides)

    def max_tokens(self, asked: int) -> int:
        """A request's max_tokens where the load asks for `asked`: at least min_max_tokens."""
        return max(asked, self.min_max_tokens or 0)

    def start(self, part: int) -> int:
        """The first index of `part`: 0 unless the workload is unique."""
        return part * PART_SIZE if self.unique else 0

    def stream_walk(self, index: int, concurrency: int, part: int = 0) -> Walk:
        """Stream `index` of `concurrency`'s walk: items index, index + concurrency, ... (of
        `part`, for a unique workload)."""
        return self.walk(lambda count: strided(self.start(part) + index, concurrency, count))

    def opening(self, index: int) -> list[Message]:
        """The first request of item `index` (a conversation's first turn)."""
        return self.walk(lambda count: iter([index])).next_request()

    def first_request(self, part: int = 0) -> list[Message]:
        return self.opening(self.start(part))


def raw_text(messages: list[Message]) -> str:
    """The messages' contents joined by blank lines, no chat template (--raw-prompts, the
    OpenAI completions endpoint); a request still starts with the one before and its answer."""
    return "\n\n".join(message["content"] for message in messages)
