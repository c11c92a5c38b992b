"""Offline replay of own-text proposals on real token streams (issue 49): at every position
past the 40th of each text, a proposal of up to 8 tokens from the text before it, scored by
how many of them the text itself continues with (what greedy verification would accept if
the text were the target's). Texts: 6 agentic first requests (loadtest/agentic.py) and the
first 20 grounded prompts, in the target's tokens. Compares the suffix walk's frequency rule
(count / (total + 1/n) after an n-token context), the same without pseudo-counts, and
prompt lookup (ngram.py).

    .venv/bin/python docs/cpu-2026-12-07/suffix_replay.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

sys.path.insert(0, "loadtest")

import specdec.loop.suffix_store as store  # noqa: E402
from common import LOADTEST, chat_template, read_prompts, read_workload  # noqa: E402
from specdec.loop.proposers.ngram import NgramIndex  # noqa: E402
from specdec.text.tokenizer import load_tokenizer  # noqa: E402


def texts() -> list[list[int]]:
    tokenizer, render = load_tokenizer("models/smollm2-135m-instruct"), chat_template()
    agentic = read_workload("agentic")
    tokens = [tokenizer.encode(render(agentic.first_request(part))) for part in range(6)]
    grounded = read_prompts(LOADTEST / "prompts_grounded.jsonl")[:20]
    return tokens + [tokenizer.encode(text) for text in grounded]


def accepted(proposal: list[int], truth: list[int]) -> int:
    count = 0
    for guess, token in zip(proposal, truth, strict=False):
        if guess != token:
            break
        count += 1
    return count


def score(propose: Callable[[list[int], int], list[int]], make, corpus) -> dict:
    proposed = hits = steps = 0
    for text in corpus:
        state = make()
        for i in range(1, len(text) - 1):
            if i >= 40:
                proposal = propose(state, text[:i])
                proposed, hits, steps = (
                    proposed + len(proposal),
                    hits + accepted(proposal, text[i:]),
                    steps + 1,
                )
            if isinstance(state, store.SuffixIndex):
                state.add(text, i)
    return {"proposed_per_step": proposed / steps, "accepted_per_step": hits / steps}


def main() -> None:
    corpus = texts()
    walk = lambda index, tail: index.walk(tail, 8, 0.1).token_ids  # noqa: E731
    print("suffix, 1/n pseudo-counts", score(walk, lambda: store.SuffixIndex(8), corpus))
    rule = store.frequency
    store.frequency = lambda followers, n: followers.best_count / followers.total
    print("suffix, no pseudo-counts", score(walk, lambda: store.SuffixIndex(8), corpus))
    store.frequency = rule
    print("ngram", score(lambda index, tail: index.propose(tail, 8), NgramIndex, corpus))


if __name__ == "__main__":
    main()
