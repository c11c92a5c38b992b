"""Incremental detokenization with the real tokenizer: chunks join to the full decode."""

from __future__ import annotations

import pytest

from specdec.text.detokenizer import IncrementalDetokenizer
from specdec.text.tokenizer import TextTokenizer

SAMPLES = [
    "Hello, world! Speculative decoding keeps the target's distribution.",
    "Emoji 🙂🚀 and accents: café, naïve, Ærøskøbing.",
    "中文文本和日本語のテキスト、한국어 텍스트",
    "def f(x):\n    return x ** 2  # spaces   and\ttabs\n",
]


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return TextTokenizer(target_dir)


@pytest.mark.parametrize("sample", SAMPLES)
def test_chunks_join_to_the_full_decode(tokenizer, sample):
    ids = tokenizer.encode(sample)
    detok = IncrementalDetokenizer(tokenizer.decode)
    chunks = []
    for token in ids:
        detok.add(token)
        text = detok.take()
        assert "\ufffd" not in text  # incomplete characters are held back
        chunks.append(text)
    chunks.append(detok.take(final=True))
    assert "".join(chunks) == tokenizer.decode(ids) == sample


def test_stop_word_across_tokens(tokenizer):
    ids = tokenizer.encode("one two three four five")
    detok = IncrementalDetokenizer(tokenizer.decode, stop_words=["ee fo"])
    hits = [detok.add(t) for t in ids]
    assert hits.index(True) == len(tokenizer.encode("one two three fo")) - 1


# Stop words whose last character alone arrives in the newest token: IncrementalDetokenizer
# looks back into the text already taken, and must look back at least len(word) - 1
# characters (of the longest word) to see the rest of the word.


def stream_until_stop(
    tokenizer: TextTokenizer, ids: list[int], stop_words: list[str]
) -> tuple[int | None, str]:
    """Feeds tokens as the loop streams them (take() after each); the position of the token
    that ends the row (None if none does) and the text taken before that token."""
    detok = IncrementalDetokenizer(tokenizer.decode, stop_words)
    for position, token in enumerate(ids):
        if detok.add(token):
            return position, detok.text
        detok.take()
    return None, detok.text


def last_character_split(tokenizer: TextTokenizer, ids: list[int], stop_word: str) -> int:
    """The position of the token that completes `stop_word`, after checking that this token
    brings only the word's last character and that the word is longer than any token, so
    the tests below keep testing the look-back if the tokenizer changes."""
    position = next(i for i in range(len(ids)) if stop_word in tokenizer.decode(ids[: i + 1]))
    before = tokenizer.decode(ids[:position])
    new = tokenizer.decode(ids[: position + 1])[len(before) :]
    assert before.endswith(stop_word[:-1]) and new.startswith(stop_word[-1])
    longest_token = max(len(tokenizer.decode([t])) for t in ids[: position + 1])
    assert len(stop_word) > longest_token
    return position


def test_a_stop_word_ends_the_row_when_only_its_last_character_is_new(tokenizer):
    """The newest token (" five") starts with the word's last character and goes on."""
    ids = tokenizer.encode("one two three four five")
    stop_word = "two three four "
    position = last_character_split(tokenizer, ids, stop_word)
    assert tokenizer.decode([ids[position]]) == " five"
    stopped_at, taken = stream_until_stop(tokenizer, ids, [stop_word])
    assert taken == tokenizer.decode(ids[:position])  # the word's head was already taken
    assert stopped_at == position


def test_a_stop_word_ending_at_a_token_boundary_ends_the_row(tokenizer):
    """The newest token is exactly the word's last character."""
    ids = tokenizer.encode(SAMPLES[0])
    stop_word = "the target's distribution."
    position = last_character_split(tokenizer, ids, stop_word)
    assert tokenizer.decode([ids[position]]) == "."
    stopped_at, taken = stream_until_stop(tokenizer, ids, [stop_word])
    assert taken == tokenizer.decode(ids[:position])
    assert stopped_at == position


@pytest.mark.parametrize("shorter_first", [True, False])
def test_a_shorter_stop_word_does_not_shorten_the_look_back(tokenizer, shorter_first):
    """The look-back is sized by the longest word, whichever order the words come in."""
    ids = tokenizer.encode(SAMPLES[0])
    stop_word = "decoding keeps the target's distribution."
    position = last_character_split(tokenizer, ids, stop_word)
    words = ["Done.", stop_word] if shorter_first else [stop_word, "Done."]
    stopped_at, taken = stream_until_stop(tokenizer, ids, words)
    assert taken == tokenizer.decode(ids[:position])
    assert stopped_at == position
