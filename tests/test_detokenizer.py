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
