"""How often the draft model's sampled proposals are accepted: coupled drawing (the rule the
loop uses, specdec/engines/coupling.py) against modified rejection sampling (the rule it
replaced).

    .venv/bin/python -m build.coupling_acceptance [--num-prompts 12] [--max-tokens 48]

The target samples an answer to each chat prompt (loadtest/prompts.jsonl, the bench's chat
workload) one token at a time; at every position both models score the same prefix with the
same processing (temperature, no top-k or top-p). For the first proposed token there:
- rejection sampling accepts with probability sum_x min(p(x), q(x)) = 1 - d (exact);
- coupled drawing accepts when the draft's and the target's Gumbel-max draws with the same
  noise agree: estimated from `--draws` noise keys per position (the real gumbel_argmax),
  and compared with the lower bound (1 - d)/(1 + d).
Writes results/coupling_acceptance.json and prints the means per temperature.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.engines.coupling import gumbel_argmax
from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import RowSampling, sampling_scores
from specdec.paths import PROJECT_ROOT

MODELS = PROJECT_ROOT / "models"


@dataclass
class AcceptanceConfig:
    target: Path = MODELS / "smollm2-135m-instruct"
    draft: Path = MODELS / "smollm2-135m-draft"
    prompts: Path = PROJECT_ROOT / "loadtest" / "prompts.jsonl"
    num_prompts: int = 12
    max_tokens: int = 48
    temperatures: tuple[float, ...] = (0.8, 1.0)
    draws: int = 256  # noise keys per position for the coupled estimate
    out: Path = PROJECT_ROOT / "results" / "coupling_acceptance.json"


def processing(temperature: float) -> RowSampling:
    return RowSampling(
        torch.tensor([temperature]),
        torch.tensor([0]),
        torch.tensor([1.0]),
        torch.tensor([-1]),
        torch.tensor([False]),
    )


def position_acceptance(
    target_scores: torch.Tensor, draft_scores: torch.Tensor, draws: int, seed: int
) -> dict[str, float]:
    """(V,) each model's sampling scores at one prefix -> the two rules' acceptance."""
    target_probs = torch.softmax(target_scores.double(), dim=-1)
    draft_probs = torch.softmax(draft_scores.double(), dim=-1)
    distance = 0.5 * float((target_probs - draft_probs).abs().sum())
    seeds = torch.arange(draws, dtype=torch.int64) + seed * draws
    positions = torch.zeros(draws, dtype=torch.int64)
    target_draws = gumbel_argmax(target_scores.expand(draws, -1), seeds, positions)
    draft_draws = gumbel_argmax(draft_scores.expand(draws, -1), seeds, positions)
    return {
        "rejection": 1 - distance,
        "coupled": float((target_draws == draft_draws).double().mean()),
        "bound": (1 - distance) / (1 + distance),
    }


def answer_positions(
    config: AcceptanceConfig,
    target: LlamaEngine,
    draft: LlamaEngine,
    prompt: list[int],
    end_id: int,
) -> list[dict]:
    """Samples the target's answer (temperature 1, its own noise) and scores every
    position with both rules at each temperature."""
    rows = []
    tokens = list(prompt)
    feed, cached = list(prompt), 0
    for step in range(config.max_tokens):
        target_logits = target.forward(torch.tensor(feed), [len(feed)], [0], [cached], [1])
        draft_logits = draft.forward(torch.tensor(feed), [len(feed)], [0], [cached], [1])
        cached += len(feed)
        row = {}
        for temperature in config.temperatures:
            scores = [
                sampling_scores(logits, processing(temperature))[0]
                for logits in (target_logits, draft_logits)
            ]
            row[str(temperature)] = position_acceptance(*scores, config.draws, seed=step)
        rows.append(row)
        seed = torch.tensor([len(rows)])
        next_token = int(gumbel_argmax(target_logits.float(), seed, torch.tensor([len(tokens)])))
        if next_token == end_id:
            break
        tokens.append(next_token)
        feed = [next_token]
    return rows


def run(config: AcceptanceConfig) -> dict:
    from loadtest.common import load_prompts
    from specdec.text.tokenizer import TextTokenizer

    prompts = load_prompts(config.prompts)[: config.num_prompts]
    target = LlamaEngine.from_checkpoint(config.target, num_slots=1, max_length=1024)
    draft = LlamaEngine.from_checkpoint(config.draft, num_slots=1, max_length=1024)
    tokenizer = TextTokenizer(config.target)
    positions: list[dict] = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        positions += answer_positions(config, target, draft, ids, tokenizer.eos_token_id)
    summary = {}
    for temperature in map(str, config.temperatures):
        values = [p[temperature] for p in positions]
        summary[temperature] = {
            rule: round(sum(v[rule] for v in values) / len(values), 4)
            for rule in ("rejection", "coupled", "bound")
        }
    report = {
        "positions": len(positions),
        "draws_per_position": config.draws,
        "prompts": len(prompts),
        "acceptance_by_temperature": summary,
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=AcceptanceConfig.num_prompts)
    parser.add_argument("--max-tokens", type=int, default=AcceptanceConfig.max_tokens)
    parser.add_argument("--draws", type=int, default=AcceptanceConfig.draws)
    args = parser.parse_args()
    config = AcceptanceConfig(
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, draws=args.draws
    )
    report = run(config)
    print(f"{report['positions']} positions of {report['prompts']} chat answers")
    print("temperature  rejection (1 - d)  coupled  bound (1 - d)/(1 + d)")
    for temperature, values in report["acceptance_by_temperature"].items():
        print(
            f"{temperature:>11}  {values['rejection']:>17.3f}  {values['coupled']:>7.3f}"
            f"  {values['bound']:>21.3f}"
        )
    print(f"wrote {config.out}")


if __name__ == "__main__":
    main()
