"""Does the draft earn its keep? Served speculation against k = 0 and against transformers.

    .venv/bin/python -m build.bench_draft            # `make bench-draft`

In one run, on held-out chat prompts (loadtest/prompts.jsonl, never trained on), 128 output
tokens, concurrency 1:
1. engine step cost at batch 1: one draft decode step against one target decode step;
2. through one Triton server: greedy k = 0, adaptive and k = 4 (interleaved per prompt),
   then temperature 0.7 (k = 0 and adaptive); acceptance from return_perf_metrics;
3. server stopped, in this process: transformers `generate` of the same target, plain and
   with the draft as `assistant_model` (same prompts, greedy).
Writes results/draft_bench.json and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.client import StreamingClient
from specdec.harness import ManagedServer
from specdec.paths import PROJECT_ROOT

MODELS = PROJECT_ROOT / "models"


@dataclass
class DraftBenchConfig:
    target: Path = MODELS / "smollm2-135m-instruct"
    draft: Path = MODELS / "smollm2-135m-draft"
    prompts: Path = PROJECT_ROOT / "loadtest" / "prompts.jsonl"
    num_prompts: int = 12
    max_tokens: int = 128
    out: Path = PROJECT_ROOT / "results" / "draft_bench.json"


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "draft_tokens": self.drafted,
        }


def held_out_prompts(config: DraftBenchConfig) -> list[str]:
    """An even spread over the categories of the prompts file, chat-formatted."""
    from specdec.text.tokenizer import TextTokenizer

    items = [json.loads(line) for line in config.prompts.read_text().splitlines() if line]
    by_category: dict[str, list[str]] = {}
    for item in items:
        by_category.setdefault(item["category"], []).append(item["prompt"])
    picked = []
    while len(picked) < config.num_prompts:
        for prompts in by_category.values():
            if prompts and len(picked) < config.num_prompts:
                picked.append(prompts.pop(0))
    tokenizer = TextTokenizer(config.target)
    return [tokenizer.apply_chat_template(p) for p in picked]


def step_costs(config: DraftBenchConfig) -> dict:
    """Median seconds of one decode step at batch 1, draft and target, same engine code."""
    from specdec.engines.llama import LlamaEngine

    costs = {}
    for role, path in (("target", config.target), ("draft", config.draft)):
        engine = LlamaEngine.from_checkpoint(path, num_slots=1, max_length=512)
        engine.forward(torch.arange(100), [100], [0], [0], [1])
        times = []
        for i in range(41):
            start = time.perf_counter()
            engine.forward(torch.tensor([7]), [1], [0], [100 + i], [1])
            times.append(time.perf_counter() - start)
        costs[f"{role}_step_ms"] = round(1000 * sorted(times)[len(times) // 2], 3)
    costs["draft_over_target"] = round(costs["draft_step_ms"] / costs["target_step_ms"], 4)
    return costs


def served(config: DraftBenchConfig, prompts: list[str]) -> dict[str, Tally]:
    modes = {
        "greedy_k0": dict(num_draft_tokens=0),
        "greedy_adaptive": {},
        "greedy_k4": dict(num_draft_tokens=4),
        "t0.7_k0": dict(num_draft_tokens=0, temperature=0.7, seed=7),
        "t0.7_adaptive": dict(temperature=0.7, seed=7),
    }
    tallies = {mode: Tally() for mode in modes}
    with ManagedServer("bench-draft") as server, StreamingClient(server.url) as client:
        client.generate(prompts[0], max_tokens=16)  # warm-up
        for prompt in prompts:
            for mode, params in modes.items():
                result = client.generate(
                    prompt,
                    max_tokens=config.max_tokens,
                    stream=True,
                    exclude_input_in_output=True,
                    return_perf_metrics=True,
                    return_num_output_tokens=True,
                    **params,
                )
                if result.error is not None:
                    raise RuntimeError(f"{mode}: {result.error}")
                tally = tallies[mode]
                tally.tokens += int(result.metrics["num_output_tokens"])
                tally.seconds += result.elapsed
                tally.drafted += int(result.metrics["total_draft_tokens"])
                tally.accepted += int(result.metrics["total_accepted_draft_tokens"])
                tally.texts.append(result.text)
    return tallies


def transformers_generate(config: DraftBenchConfig, prompts: list[str]) -> dict[str, Tally]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from build.hf_draft import load_hf_draft

    tokenizer = AutoTokenizer.from_pretrained(str(config.target))
    target = AutoModelForCausalLM.from_pretrained(str(config.target), dtype=torch.float32)
    assistant = load_hf_draft(config.draft)
    tallies = {"hf_plain": Tally(), "hf_assisted": Tally()}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        for mode, extra in (("hf_plain", {}), ("hf_assisted", {"assistant_model": assistant})):
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(
                    ids, max_new_tokens=config.max_tokens, do_sample=False, **extra
                )
            tally = tallies[mode]
            tally.seconds += time.perf_counter() - start
            tally.tokens += out.shape[1] - ids.shape[1]
            tally.texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return tallies


def run(config: DraftBenchConfig) -> dict:
    prompts = held_out_prompts(config)
    costs = step_costs(config)
    print(
        f"step at batch 1: draft {costs['draft_step_ms']} ms, target "
        f"{costs['target_step_ms']} ms, ratio {costs['draft_over_target']}",
        flush=True,
    )
    tallies = served(config, prompts)
    tallies.update(transformers_generate(config, prompts))
    summary = {mode: t.summary() for mode, t in tallies.items()}
    rate = {mode: s["tokens_per_s"] for mode, s in summary.items()}
    ratios = {
        "served_adaptive_over_k0": rate["greedy_adaptive"] / rate["greedy_k0"],
        "served_k4_over_k0": rate["greedy_k4"] / rate["greedy_k0"],
        "served_adaptive_over_hf_assisted": rate["greedy_adaptive"] / rate["hf_assisted"],
        "hf_assisted_over_hf_plain": rate["hf_assisted"] / rate["hf_plain"],
        "t0.7_adaptive_over_k0": rate["t0.7_adaptive"] / rate["t0.7_k0"],
    }
    same_text = sum(
        a == b
        for a, b in zip(tallies["greedy_adaptive"].texts, tallies["hf_plain"].texts, strict=True)
    )
    report = {
        "prompts": len(prompts),
        "max_tokens": config.max_tokens,
        "step_costs": costs,
        "modes": summary,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "greedy_served_equals_hf": f"{same_text}/{len(prompts)}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2))
    print("| mode | tokens/s | acceptance |\n|---|---|---|")
    for mode, s in summary.items():
        acceptance = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        print(f"| {mode} | {s['tokens_per_s']:.1f} | {acceptance} |")
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}x")
    print(f"greedy served text equal to transformers: {report['greedy_served_equals_hf']}")
    print(f"wrote {config.out}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft", type=Path, default=DraftBenchConfig.draft)
    args = parser.parse_args()
    run(
        DraftBenchConfig(num_prompts=args.num_prompts, max_tokens=args.max_tokens, draft=args.draft)
    )


if __name__ == "__main__":
    main()
