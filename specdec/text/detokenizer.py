"""Incremental detokenization and stop words.

A token can end in the middle of a UTF-8 character, and byte-level BPE tokens carry their
leading space, so text is cut from the decode of a small window of tokens that starts at a
clean boundary: delta = decode(window)[len(decode(context)):], where the context is the
window's already-emitted head. Text that ends in U+FFFD (an incomplete character) is held
back until a later token completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


def text_delta(decode: Decode, window_ids: Sequence[int], num_context_ids: int) -> str:
    """New text of `window_ids` past its first `num_context_ids` tokens."""
    context = decode(window_ids[:num_context_ids]) if num_context_ids else ""
    return decode(window_ids)[len(context) :]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, stop_words: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop_words = [w for w in stop_words if w]
        self.token_ids: list[int] = []
        self.text = ""  # all text emitted so far
        self._prefix_offset = 0  # start of the decode window (a clean boundary)
        self._read_offset = 0  # tokens before this are already in self.text

    def add(self, token_id: int) -> bool:
        """Appends one token; returns True when the text now contains a stop word."""
        self.token_ids.append(token_id)
        if not self.stop_words:
            return False
        tail_start = len(self.text) - max(len(w) for w in self.stop_words)
        pending = text_delta(
            self.decode,
            self.token_ids[self._prefix_offset :],
            self._read_offset - self._prefix_offset,
        )
        tail = self.text[max(0, tail_start) :] + pending
        return any(word in tail for word in self.stop_words)

    def take(self, final: bool = False) -> str:
        """The text not yet taken; an incomplete character is held back unless final."""
        window = self.token_ids[self._prefix_offset :]
        num_context = self._read_offset - self._prefix_offset
        text = text_delta(self.decode, window, num_context)
        if not final and (not text or text.endswith("\ufffd")):
            return ""
        self.text += text
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return text
