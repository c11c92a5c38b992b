"""The target's greedy answers to the structured workload, each under its request's grammar,
offline: the measurement behind structured.MAX_TOKENS (docs/benchmarks.md, the method).

    .venv/bin/python loadtest/structured_answers.py [--whitespace compact|any] [--out FILE]

Transformers' `generate` on the target in float32, greedy, with xgrammar's logits processor
(xgrammar.contrib.hf) for each request's JSON schema, up to LIMIT tokens. Writes one line per
request: its last user message, its output tokens (the end token not counted), whether the
end token came, and the text. The schemas compile as the server compiles them
(specdec/engines/grammar.py), with `--whitespace` as its GUIDED_JSON_WHITESPACE (compact
by default: a space after each comma and colon, none elsewhere; any: whitespace anywhere
between JSON's tokens). tests/test_structured.py checks the written answers against their schemas
and MAX_TOKENS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import STRUCTURED
from specdec.engines.grammar import JSON_WHITESPACES, Grammars
from specdec.paths import PROJECT_ROOT
from structured import read_structured

MODEL = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
ANSWERS = PROJECT_ROOT / "loadtest" / "structured_answers.jsonl"
LIMIT = 400  # well past any answer: one that reaches it shows up as not ended


def answer_all(whitespace: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    grammars = Grammars.for_tokenizer(
        str(MODEL), model.config.vocab_size, json_whitespace=whitespace
    )
    answers = []
    for messages, guide in zip(*read_structured(STRUCTURED["structured"]), strict=True):
        grammar = grammars.compile((guide.guide_type, guide.guide))
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # (1, prompt tokens)
        with torch.no_grad():
            output = model.generate(
                input_ids,
                max_new_tokens=LIMIT,
                do_sample=False,
                logits_processor=[LogitsProcessor(grammar)],
                pad_token_id=tokenizer.eos_token_id,
            )[0, input_ids.shape[1] :].tolist()
        ended = output[-1] == tokenizer.eos_token_id
        tokens = output[:-1] if ended else output
        answer = {
            "request": messages[-1]["content"],
            "num_output_tokens": len(tokens),
            "ended": ended,
            "text": tokenizer.decode(tokens),
        }
        print(json.dumps(answer), flush=True)
        answers.append(answer)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whitespace", choices=JSON_WHITESPACES, default=JSON_WHITESPACES[0])
    parser.add_argument("--out", type=Path, default=ANSWERS)
    args = parser.parse_args()
    answers = answer_all(args.whitespace)
    args.out.write_text("".join(json.dumps(answer) + "\n" for answer in answers))
    longest = max(answer["num_output_tokens"] for answer in answers)
    ended = sum(answer["ended"] for answer in answers)
    print(f"{ended}/{len(answers)} ended; the longest answer: {longest} tokens; wrote {args.out}")


if __name__ == "__main__":
    main()
