"""What the grammar proposer can reach on the structured workload, offline: tokens per target
pass if each pass proposed, from the answer so far, the grammar's own tokens and prompt
lookup's continuation, against the target's greedy answers (loadtest/structured_answers.py).

    .venv/bin/python loadtest/grammar_offers.py [--whitespace compact|any] [--answers FILE]

An upper bound of the grammar proposer's reach, not a measurement of the server: every pass
proposes (no cost model), k = 8, and an answer's tokens are its text as the tokenizer splits
it (greedy decoding may have split it otherwise). Rules, each a proposal per pass:
- forced: the tokens the mask allows alone (certain);
- forced+lookup: those, then prompt lookup's continuation where the grammar allows it;
- jump: forced tokens, then the text the grammar writes itself as the tokenizer splits it
  (specdec/engines/grammar.py, jump_forward_tokens);
- jump+lookup: the grammar proposer's offer (specdec/loop/proposers/grammar.py).
The answers must have been written under the same whitespace (structured_answers.py
--whitespace) for the grammar to take them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from structured_answers import ANSWERS, MODEL

from common import STRUCTURED, target_passes
from specdec.engines.grammar import JSON_WHITESPACES, Grammars, PositionedMatchers
from specdec.loop.proposers.grammar import grammar_offer
from specdec.loop.proposers.ngram import NgramIndex
from structured import read_structured

K = 8
RULES = ("forced", "forced+lookup", "jump", "jump+lookup")


def proposal(rule: str, grammars: Grammars, matcher, index: NgramIndex, text: list[int]):
    """The rule's proposal after `text` (the grammar proposer's offer where rule is
    jump+lookup)."""
    lookup = None
    if rule.endswith("lookup"):

        def lookup(own, room):
            return index.propose(text, room, then=own)

    return grammar_offer(grammars, matcher, K, lookup, jump=rule.startswith("jump"))[0]


def passes(rule: str, grammars: Grammars, guide, prompt: list[int], answer: list[int]) -> int:
    """Target passes to write `answer` (its end token included) proposing by `rule`."""
    matchers, index = PositionedMatchers(grammars), NgramIndex()

    def propose(position: int) -> list[int]:
        matcher = matchers.at(0, guide, answer[-1], answer[:position])
        if matcher is None:
            return []
        return proposal(rule, grammars, matcher, index, prompt + answer[:position])

    return target_passes(answer, propose)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whitespace", choices=JSON_WHITESPACES, default=JSON_WHITESPACES[0])
    parser.add_argument("--answers", type=Path, default=ANSWERS)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    grammars = Grammars.for_tokenizer(str(MODEL), 49_152, json_whitespace=args.whitespace)
    answers = [json.loads(line) for line in args.answers.read_text().splitlines()]
    totals = dict.fromkeys(RULES, 0)
    num_tokens = 0
    for answer, messages, guide in zip(
        answers, *read_structured(STRUCTURED["structured"]), strict=True
    ):
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(answer["text"], add_special_tokens=False) + [
            tokenizer.eos_token_id
        ]
        num_tokens += len(answer_ids)
        for rule in RULES:
            totals[rule] += passes(
                rule, grammars, (guide.guide_type, guide.guide), prompt_ids, answer_ids
            )
    print(
        f"{len(answers)} answers, {num_tokens} tokens (end tokens included), "
        f"JSON whitespace {args.whitespace}"
    )
    print(f"{'no proposals':15s} tokens/pass 1.00")
    for rule, count in totals.items():
        print(f"{rule:15s} tokens/pass {num_tokens / count:.2f}")


if __name__ == "__main__":
    main()
