"""Verification of draft tokens: greedy matching and modified rejection sampling.

Rejection sampling after Leviathan et al. (arXiv 2211.17192) and Chen et al.
(arXiv 2302.01318): accept draft token x with probability min(1, target(x) / draft(x));
at the first rejection, draw a recovered token from norm(max(0, target - draft)); when all
draft tokens are accepted, draw a bonus token from the target's next distribution. The
emitted tokens are then distributed exactly as the target would have produced them.

A model-free proposer (prompt lookup) proposes a token without a distribution: its draft
distribution is a point mass on that token, so the rule becomes accept x with probability
target(x), and on rejection draw from the target with x removed, renormalised. Still exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engines.sampling import sample_token


@dataclass
class Verdict:
    num_accepted: int  # draft tokens accepted, 0..k
    token_ids: list[int]  # accepted draft tokens + one recovered or bonus token (k + 1 at most)


def verify_greedy(
    draft_token_ids: list[int],  # (k,)
    target_token_ids: list[int],  # (k + 1,) target argmax after each prefix
) -> Verdict:
    """Greedy: accept the longest prefix where the draft equals the target's argmax."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and (
        draft_token_ids[num_accepted] == target_token_ids[num_accepted]
    ):
        num_accepted += 1
    emitted = list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]]
    return Verdict(num_accepted, emitted)


def rejection_sample(
    draft_token_ids: list[int],  # (k,)
    draft_probs: torch.Tensor | None,  # (k, V) the draft's distribution; None: point masses
    target_probs: torch.Tensor,  # (k + 1, V) the target's distribution after each prefix
    generator: torch.Generator,
) -> Verdict:
    """Sampling: modified rejection sampling, one uniform draw per draft token."""
    k = len(draft_token_ids)
    for i, token in enumerate(draft_token_ids):
        draft_p = 1.0 if draft_probs is None else float(draft_probs[i, token])
        target_p = float(target_probs[i, token])
        uniform = float(torch.rand((), generator=generator))
        # draft_p > 0 for a sampled token; accept with probability min(1, target/draft).
        if draft_p > 0 and uniform * draft_p < target_p:
            continue
        if draft_probs is None:  # max(0, target - point mass) is the target without x
            residual = target_probs[i].clone()
            residual[token] = 0
        else:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        total = float(residual.sum())
        # total == 0 only if target == draft, where rejection has probability 0; guard anyway.
        recovered = sample_token(residual / total if total > 0 else target_probs[i], generator)
        return Verdict(i, list(draft_token_ids[:i]) + [recovered])
    bonus = sample_token(target_probs[k], generator)
    return Verdict(k, list(draft_token_ids) + [bonus])
