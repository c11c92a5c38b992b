"""Greedy parity below float32 exactness: the tie-aware rule of the precision contract.

Two numerically different paths through the same model (a verify of k + 1 tokens against
one-token steps; a GPU's kernels against the CPU's; bfloat16 or float16 against float32)
may pick different tokens where the reference's two best logits are nearly tied: their
greedy texts may part there, and only there. A divergence where the reference's top-2 gap
is TIE_MARGIN or more is a bug. README, Exactness, and docs/design.md, Precision;
tests/test_bfloat16_server.py and build/gpu_check.py apply the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The reference's top-2 logit gap below which two paths may disagree. Below float32 the torch
# engine's matrices (the head too) and attention compute in bfloat16 or float16, which two
# paths round differently; its residual stream and norms stay float32, and each position's
# top 16 logits are recomputed in float32, so the top two are not rounded onto bfloat16's
# coarse steps.
# A chosen bound, not a measured one (docs/benchmarks.md, Precision).
TIE_MARGIN = 0.25

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Divergence:
    prompt: int  # index of the prompt
    token: int  # the reference's first token that the text does not continue
    gap: float  # the reference's top-2 logit gap there

    def near_tie(self, margin: float = TIE_MARGIN) -> bool:
        return self.gap < margin


@torch.inference_mode()
def greedy_path(
    engine, prompt_ids: list[int], max_tokens: int, eos_token_id: int | None
) -> tuple[list[int], list[float]]:
    """Plain greedy decoding of one prompt in slot 0 of `engine` (LlamaEngine's surface),
    one token per call: the token ids and each one's top-2 logit gap."""
    logits = engine.forward(torch.tensor(prompt_ids), [len(prompt_ids)], [0], [0], [1])  # (1, V)
    ids, gaps, length = [], [], len(prompt_ids)
    for _ in range(max_tokens):
        top = logits[0].float().topk(2)
        ids.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        if ids[-1] == eos_token_id:
            break
        logits = engine.forward(torch.tensor(ids[-1:]), [1], [0], [length], [1])
        length += 1
    return ids, gaps


def first_divergence(decode: Decode, ids: Sequence[int], text: str) -> int | None:
    """Index of the first of the reference's tokens `ids` whose text `text` does not
    continue; None where it continues all of them."""
    for i in range(len(ids)):
        if not text.startswith(decode(ids[: i + 1])):
            return i
    return None


def find_divergences(
    decode: Decode,
    paths: Sequence[tuple[list[int], list[float]]],
    texts: Sequence[str],
    eos_token_id: int | None,
) -> list[Divergence]:
    """Each text against its reference path (greedy_path's ids and gaps; a final end
    token is not text): where it first leaves the path, and how near a tie that was."""
    found = []
    for prompt, ((ids, gaps), text) in enumerate(zip(paths, texts, strict=True)):
        if ids[-1:] == [eos_token_id]:
            ids = ids[:-1]
        position = first_divergence(decode, ids, text)
        if position is not None:
            found.append(Divergence(prompt, position, gaps[position]))
    return found
