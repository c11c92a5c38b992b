"""Measures the tie margins of the bfloat16 contract (build/greedy_parity.py).

    .venv/bin/python -m build.tie_margin        # results/tie_margin.{json,md}, ~20 min on 2 cores

For each prompt, plain greedy decoding in bfloat16 (one token per call, through the end
token, --num-tokens positions) is the reference path; its top two tokens a, b at each
position give a gap l_a - l_b. The same output is then teacher-forced:
1. verify: through verifies of k + 1 tokens from a cache offset, as the server's target
   computes them: each width of --widths alone at every alignment (the first call feeds
   `offset` tokens, then `width` at a time), and every prompt in one batch per call (rows
   of alternating widths, --batched-passes alignments), as the bfloat16 server test's
   concurrent batch;
2. precision: float32 plain greedy decoding is the reference path instead, and bfloat16
   one-token steps are teacher-forced along it.
The move at a position is |(l_a - l_b) on the other path - (l_a - l_b) on the reference|.
TIE_MARGIN must lie between the largest verify move and twice it, PRECISION_MARGIN likewise
for the precision moves; the report says whether the committed values do, and suggests 1.5x.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from build import greedy_parity
from build.greedy_parity import GapMove, gap_moves, greedy_top2, precision_moves
from specdec.paths import PROJECT_ROOT

# The bfloat16 server test's prompts (tests/test_bfloat16_server.py): chat, arithmetic,
# spelling, YAML, code, a story, a list, SQL.
PROMPTS = [
    "<|im_start|>user\nList three uses of copper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nFix the spelling: Teh quick brwon fox jumpd over the lazzy dog and "
    "ran into the forrest.<|im_end|>\n<|im_start|>assistant\n",
    '<|im_start|>user\nConvert to YAML: {"name": "web", "port": 8080, "replicas": 3, '
    '"env": {"DEBUG": "false", "REGION": "eu-west"}}<|im_end|>\n<|im_start|>assistant\n',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a village at the edge of the forest,",
    "<|im_start|>user\nRepeat this list, numbered: apples, pears, plums, cherries, grapes, "
    "figs.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM orders",
]
SUGGESTED_FACTOR = 1.5  # a margin 1.5x the largest move: inside [1x, 2x] with room both ways

Top2 = tuple[list[int], list[int], list[float]]


@dataclass
class TieMarginConfig:
    target: Path = PROJECT_ROOT / "models" / "smollm2-135m-instruct"
    num_prompts: int = len(PROMPTS)
    num_tokens: int = 128
    widths: list[int] = field(default_factory=lambda: [5, 9])  # k + 1 of draft k=4, lookup k=8
    batched_passes: int = 2
    out: Path = PROJECT_ROOT / "results" / "tie_margin.json"


def host() -> dict:
    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bfloat16_instructions": [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()],
    }


def summary(moves: list[tuple[int, GapMove]]) -> dict:
    """(prompt, move) pairs: their count, largest and 99th-percentile move, where the
    largest was, and the argmax flips with the reference's gap at each."""
    values = sorted(m.move for _, m in moves)
    prompt, worst = max(moves, key=lambda pm: pm[1].move)
    flips = [{"prompt": p, **asdict(m)} for p, m in moves if m.flipped]
    return {
        "positions": len(moves),
        "max_move": round(values[-1], 6),
        "p99_move": round(values[int(0.99 * (len(values) - 1))], 6),
        "mean_move": round(sum(values) / len(values), 6),
        "worst": {"prompt": prompt, **asdict(worst)},
        "flips": flips,
        "max_gap_at_flip": max((f["gap"] for f in flips), default=None),
    }


def verify_figures(config: TieMarginConfig, engine, prompts: list[list[int]]) -> dict:
    """The reference paths, then every verify of them: moves by mode and by prompt."""
    top2s: list[Top2] = [greedy_top2(engine, p, config.num_tokens, None) for p in prompts]
    outputs = [top2[0] for top2 in top2s]
    by_mode: dict[str, list[tuple[int, GapMove]]] = {}
    for width in config.widths:
        for offset in range(width):
            for r, prompt in enumerate(prompts):
                found = gap_moves(engine, [prompt], [outputs[r]], [top2s[r]], [width], [offset])
                by_mode.setdefault(f"alone, {width} tokens", []).extend((r, m) for m in found[0])
    for p in range(config.batched_passes):
        widths = [config.widths[r % len(config.widths)] for r in range(len(prompts))]
        offsets = [(r + 3 * p) % w for r, w in enumerate(widths)]
        found = gap_moves(engine, prompts, outputs, top2s, widths, offsets)
        by_mode.setdefault("batch of all prompts", []).extend(
            (r, m) for r, row in enumerate(found) for m in row
        )
    every = [pm for moves in by_mode.values() for pm in moves]
    return {
        "all": summary(every),
        "by_mode": {mode: summary(moves) for mode, moves in by_mode.items()},
        "max_move_by_prompt": [
            round(max(m.move for p, m in every if p == r), 6) for r in range(len(prompts))
        ],
    }


def precision_figures(config: TieMarginConfig, prompts: list[list[int]], bfloat16) -> dict:
    from specdec.engines.llama import LlamaEngine

    length = max(len(p) for p in prompts) + config.num_tokens
    float32 = LlamaEngine.from_checkpoint(config.target, 1, length, dtype=torch.float32)
    every: list[tuple[int, GapMove]] = []
    for r, prompt in enumerate(prompts):
        top2 = greedy_top2(float32, prompt, config.num_tokens, None)
        every += [(r, m) for m in precision_moves(bfloat16, prompt, top2)]
    return {
        "all": summary(every),
        "max_move_by_prompt": [
            round(max(m.move for p, m in every if p == r), 6) for r in range(len(prompts))
        ],
    }


def bounds(max_move: float, margin: float) -> dict:
    return {
        "committed": margin,
        "holds": max_move <= margin <= 2 * max_move,
        "suggested": math.ceil(SUGGESTED_FACTOR * max_move * 1000) / 1000,
    }


def run(config: TieMarginConfig) -> dict:
    from specdec.engines.llama import LlamaEngine
    from specdec.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(config.target))
    prompts = [tokenizer.encode(p) for p in PROMPTS[: config.num_prompts]]
    length = max(len(p) for p in prompts) + config.num_tokens
    started = time.time()
    bfloat16 = LlamaEngine.from_checkpoint(
        config.target, len(prompts), length, dtype=torch.bfloat16
    )
    verify = verify_figures(config, bfloat16, prompts)
    precision = precision_figures(config, prompts, bfloat16)
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "host": host(),
        "seconds": round(time.time() - started),
        "verify": verify,
        "precision": precision,
        "tie_margin": bounds(verify["all"]["max_move"], greedy_parity.TIE_MARGIN),
        "precision_margin": bounds(precision["all"]["max_move"], greedy_parity.PRECISION_MARGIN),
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=1) + "\n")
    config.out.with_suffix(".md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    rows = [
        "| path against its reference | positions | max move | p99 | mean | flips | "
        "largest gap at a flip |",
        "|---|---|---|---|---|---|---|",
    ]
    groups = {**report["verify"]["by_mode"], "bfloat16 against float32": report["precision"]["all"]}
    for name, s in groups.items():
        flip_gap = "-" if s["max_gap_at_flip"] is None else f"{s['max_gap_at_flip']:.4f}"
        rows.append(
            f"| {name} | {s['positions']} | {s['max_move']:.4f} | {s['p99_move']:.4f} | "
            f"{s['mean_move']:.4f} | {len(s['flips'])} | {flip_gap} |"
        )
    lines = [*rows, ""]
    for name, key in (("verify", "tie_margin"), ("precision", "precision_margin")):
        s, b = report[name]["all"], report[key]
        lines.append(
            f"- {name}: largest move {s['max_move']:.4f} (prompt {s['worst']['prompt']}, "
            f"position {s['worst']['position']}); per prompt "
            f"{', '.join(f'{m:.3f}' for m in report[name]['max_move_by_prompt'])}; "
            f"{key.upper()} {b['committed']} {'holds' if b['holds'] else 'does NOT hold'} "
            f"(suggested {b['suggested']})"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> TieMarginConfig:
    defaults = TieMarginConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=defaults.target)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--num-tokens", type=int, default=defaults.num_tokens)
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default="5,9")
    parser.add_argument("--batched-passes", type=int, default=defaults.batched_passes)
    parser.add_argument("--out", type=Path, default=defaults.out)
    return TieMarginConfig(**vars(parser.parse_args(argv)))


def main() -> None:
    report = run(parse_args())
    print(markdown(report), end="")
    print(f"wrote {report['config']['out']} and its .md")


if __name__ == "__main__":
    main()
