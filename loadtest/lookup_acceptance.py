"""What prompt lookup could win on a workload's greedy answers, with and without penalties.

Speculation's gain from a lookup proposer is bounded by how often the answer repeats text
it has seen: the tokens its proposals would have had accepted. Presence and frequency
penalties exist to make an answer repeat less, so they lower that bound whatever the loop
does. This measures it offline, without a server: for each prompt of a workload,
transformers' greedy answer (float32, the target's weights) with and without the penalties
(counted over the output, as the OpenAI API counts them), and at every position the prompt
lookup proposal that specdec/loop/proposers/ngram.py would make (up to 8 tokens), scored
against the answer that follows: offers, first tokens accepted, tokens accepted, by match
length and by whether the proposal's first token is one the penalties count; and the
tokens one target pass emits when prompt lookup proposes 8 tokens every step.

    python loadtest/lookup_acceptance.py --workloads chat,grounded --prompts 16

writes results/lookup-acceptance.json and prints a table (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PROJECT_ROOT, chat_template, read_workload, target_passes  # noqa: E402
from specdec.loop.proposers.ngram import NgramIndex  # noqa: E402
from specdec.text.tokenizer import load_tokenizer  # noqa: E402

TARGET = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
MAX_DRAFT = 8


def greedy_answer(model, prompt_ids: list[int], penalty: float, max_tokens: int, end: int):
    """Greedy tokens after the prompt; presence and frequency `penalty` over the output."""
    output: list[int] = []
    counts: collections.Counter[int] = collections.Counter()
    past, step = None, torch.tensor([prompt_ids])
    with torch.inference_mode():
        for _ in range(max_tokens):
            result = model(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].clone()
            for token, count in counts.items():
                logits[token] -= penalty + penalty * count
            token = int(logits.argmax())
            if token == end:
                break
            output.append(token)
            counts[token] += 1
            step = torch.tensor([[token]])
    return output


def passes_at_k(prompt_ids: list[int], output: list[int], k: int = MAX_DRAFT) -> int:
    """Target passes to emit `output` with prompt lookup proposing up to k tokens every
    step."""
    index = NgramIndex()
    return target_passes(output, lambda p: index.propose(list(prompt_ids) + output[:p], k))


def score(prompt_ids: list[int], output: list[int]) -> dict[str, list[int]]:
    """Per class: [offers, first tokens accepted, tokens accepted]."""
    stats: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    index, text = NgramIndex(), list(prompt_ids)
    for j, token in enumerate(output):
        proposal = index.propose(text, MAX_DRAFT)
        if proposal:
            accepted = 0
            for proposed, actual in zip(proposal, output[j:], strict=False):
                if proposed != actual:
                    break
                accepted += 1
            counted = "first counted" if proposal[0] in output[:j] else "first fresh"
            for name in ("all", counted, f"match {index.match_length}"):
                entry = stats[name]
                entry[0] += 1
                entry[1] += accepted > 0
                entry[2] += accepted
        text.append(token)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="chat,grounded")
    parser.add_argument("--prompts", type=int, default=16, help="per workload")
    parser.add_argument("--penalty", type=float, default=0.5, help="presence and frequency")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--out", type=Path, default=PROJECT_ROOT / "results" / "lookup-acceptance.json"
    )
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = load_tokenizer(str(TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    template = chat_template()
    table: dict[str, dict] = {}
    for workload in args.workloads.split(","):
        requests = read_workload(workload).requests[: args.prompts]
        for penalty in (0.0, args.penalty):
            totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
            num_tokens = num_passes = 0
            for messages in requests:
                prompt_ids = tokenizer.encode(template(messages))
                output = greedy_answer(
                    model, prompt_ids, penalty, args.max_tokens, tokenizer.eos_token_id
                )
                num_tokens += len(output)
                num_passes += passes_at_k(prompt_ids, output)
                for name, (offers, firsts, accepted) in score(prompt_ids, output).items():
                    entry = totals[name]
                    entry[0] += offers
                    entry[1] += firsts
                    entry[2] += accepted
            key = f"{workload} penalty {penalty}"
            table[key] = {
                "output_tokens": num_tokens,
                "requests": len(requests),
                # what prompt lookup at k = 8 on every step makes of one target pass
                "tokens_per_pass_k8": num_tokens / num_passes if num_passes else 0.0,
            }
            for name, (offers, firsts, accepted) in sorted(totals.items()):
                table[key][name] = {
                    "offers": offers,
                    "first_accepted": firsts / offers if offers else 0.0,
                    "accepted_per_offer": accepted / offers if offers else 0.0,
                }
            print(key, json.dumps(table[key]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
