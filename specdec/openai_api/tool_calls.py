"""The text a model writes to call a tool, and a parser that reads it back as OpenAI's
`tool_calls`, whole or streamed (docs/openai.md, Tools).

The format (Hermes-style; SmolLM2's chat template has no tool support of its own), one block
per call, the arguments a JSON object:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Free text may come before, between and after the blocks (tool_choice "auto"). The parser
turns the text into OpenAI's chat deltas: `{"content": ...}` for free text, and per call one
delta with its index, id, type and name (arguments "") followed by deltas with pieces of
the arguments' JSON text, as OpenAI streams them. What it emits depends only on the text,
never on where the chunks split it. The content is the text outside the blocks, stripped:
whitespace is held back until more text shows it is inside the content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_END = "}\n" + CALL_CLOSE  # closes the {"name", "arguments"} object, then the block
# The block up to its arguments: "name" first, then "arguments" (any whitespace between).
_CALL_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)', re.DOTALL
)


def call_begin(name: str) -> str:
    """The text of a call up to its arguments (name: [A-Za-z0-9_-], as OpenAI's)."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    """One whole call, as the model writes it (`arguments`: the JSON object's text)."""
    return call_begin(name) + arguments + CALL_END


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text as written so far
    complete: bool = False  # its block was closed

    def as_openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class _JsonValueEnd:
    """Finds where one JSON value ends in text that arrives in pieces: tracks nesting and
    strings (a brace inside a string does not count)."""

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar", from its first character
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, char in enumerate(text):
            if not self.kind:
                self.kind = {"{": "container", "[": "container", '"': "string"}.get(char, "scalar")
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif char == '"':
                self.in_string = True
            elif self.kind == "scalar":
                self.done = char in ",}] \t\r\n"
                if self.done:
                    return i  # the delimiter is not part of the value
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            if self.done:
                return i + 1
        return len(text)


class ToolCallParser:
    """Reads a chat answer in the format above, fed in pieces: `feed` returns the deltas the
    new text settles, `finish` the rest. `content` and `calls` hold the answer so far."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.content = ""
        self.calls: list[ToolCall] = []
        self._pending = ""  # text read but not yet settled
        self._space = ""  # whitespace at the end of the content so far, held back
        self._state = self._text
        self._arguments_end = _JsonValueEnd()
        self._deltas: list[dict] = []

    @property
    def calls_complete(self) -> bool:
        """At least one call, and every call's block closed."""
        return bool(self.calls) and all(call.complete for call in self.calls)

    def feed(self, text: str) -> list[dict]:
        self._pending += text
        while self._state():
            pass
        return self._take_deltas()

    def finish(self) -> list[dict]:
        """The end of the answer: text held back is content; a block whose header never
        completed is content too (as written); a call cut in its arguments stays incomplete."""
        if self._state == self._text:
            self._add_text(self._pending)
        elif self._state == self._header:
            self._add_text(CALL_OPEN + self._pending)
        self._pending = self._space = ""
        return self._take_deltas()

    # -- states: each reads from _pending and returns whether it made progress ------------
    def _text(self) -> bool:
        start = self._pending.find(CALL_OPEN)
        if start >= 0:
            self._add_text(self._pending[:start])
            self._pending = self._pending[start + len(CALL_OPEN) :]
            self._state = self._header
            return True
        held = overlap_with_start(self._pending, CALL_OPEN)  # may begin a block
        self._add_text(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _header(self) -> bool:
        match = _CALL_HEADER.match(self._pending)
        if match:
            call = ToolCall(self.new_id(), json.loads(f'"{match.group(1)}"'))
            function = {"name": call.name, "arguments": ""}
            start = {"index": len(self.calls), "id": call.id, "type": "function"}
            self._deltas.append({"tool_calls": [{**start, "function": function}]})
            self.calls.append(call)
            self._pending = self._pending[match.end() :]
            self._state, self._arguments_end = self._arguments, _JsonValueEnd()
            return True
        end = self._pending.find(CALL_CLOSE)
        if end < 0:
            return False
        # A block without a call in it: it stays text, as written.
        end += len(CALL_CLOSE)
        self._add_text(CALL_OPEN + self._pending[:end])
        self._pending, self._state = self._pending[end:], self._text
        return True

    def _arguments(self) -> bool:
        size = self._arguments_end.feed(self._pending)
        piece, self._pending = self._pending[:size], self._pending[size:]
        if piece:
            call = self.calls[-1]
            call.arguments += piece
            index = len(self.calls) - 1
            self._deltas.append(
                {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
            )
        if self._arguments_end.done:
            self._state = self._closing
        return self._arguments_end.done

    def _closing(self) -> bool:
        end = self._pending.find(CALL_CLOSE)
        if end < 0:
            return False
        self._pending = self._pending[end + len(CALL_CLOSE) :]
        self.calls[-1].complete = True
        self._state = self._text
        return True

    # -- output -------------------------------------------------------------------------
    def _add_text(self, text: str) -> None:
        """Text outside the blocks, in order: content, but for whitespace at its start, and
        whitespace at its end until more text follows."""
        text = self._space + text
        settled = text.rstrip()
        self._space = text[len(settled) :]
        if not self.content:
            settled = settled.lstrip()
        if settled:
            self.content += settled
            self._deltas.append({"content": settled})

    def _take_deltas(self) -> list[dict]:
        """This feed's deltas, neighbours of one kind (text, or one call's arguments) merged."""
        merged: list[dict] = []
        for delta in self._deltas:
            if merged and _same_kind(merged[-1], delta):
                merged[-1] = _joined(merged[-1], delta)
            else:
                merged.append(delta)
        self._deltas = []
        return merged


def _same_kind(first: dict, second: dict) -> bool:
    if "content" in first and "content" in second:
        return True
    calls = first.get("tool_calls"), second.get("tool_calls")
    if not (calls[0] and calls[1]):
        return False
    a, b = calls[0][0], calls[1][0]
    return a["index"] == b["index"] and "id" not in a and "id" not in b


def _joined(first: dict, second: dict) -> dict:
    if "content" in first:
        return {"content": first["content"] + second["content"]}
    a, b = first["tool_calls"][0], second["tool_calls"][0]
    arguments = a["function"]["arguments"] + b["function"]["arguments"]
    return {"tool_calls": [{"index": a["index"], "function": {"arguments": arguments}}]}


def overlap_with_start(text: str, word: str) -> int:
    """Length of the longest end of `text` that begins `word` (shorter than `word`): what a
    streamed reader holds back until the next piece shows whether `word` follows."""
    for size in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-size:]):
            return size
    return 0
