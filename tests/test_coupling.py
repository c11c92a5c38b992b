"""Gumbel-max sampling with keyed noise (specdec/engines/coupling.py): exact draws, the same
tokens whether all the noise is made or only the blocks that can win."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.engines.coupling import BLOCK, gumbel_argmax, gumbel_argmax_dense
from stats import chi_square, critical_0_001


def scores_of(kind: str, rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    scores = torch.randn(rows, vocab, generator=generator, dtype=torch.float32)
    if kind == "flat":  # a random model's: every block may win
        return scores * 0.01
    if kind == "peaked":  # a trained model's: few blocks may win
        return scores * 4
    if kind == "top-k":  # most tokens excluded, so most blocks hold nothing
        kth = scores.topk(min(5, vocab), dim=-1).values[:, -1:]
        return scores.masked_fill(scores < kth, -math.inf)
    if kind == "ties":  # equal scores: the lowest token id must win either way
        return torch.zeros(rows, vocab)
    return scores


@pytest.mark.parametrize("vocab", [3, BLOCK, 200, 4096])
@pytest.mark.parametrize("kind", ["normal", "flat", "peaked", "top-k", "ties"])
def test_only_the_blocks_that_can_win_give_the_same_tokens(vocab, kind):
    generator = torch.Generator().manual_seed(vocab)
    scores = scores_of(kind, 64, vocab, generator)
    seeds = torch.randint(0, 2**62, (64,), generator=generator)
    positions = torch.randint(0, 100_000, (64,), generator=generator)
    tokens = gumbel_argmax(scores, seeds, positions)
    assert torch.equal(tokens, gumbel_argmax_dense(scores, seeds, positions))
    assert bool((tokens < vocab).all())
    assert bool(torch.isfinite(scores.gather(-1, tokens[:, None])).all())


@pytest.mark.parametrize("vocab", [5, 200])  # one block, and several with a padded last one
def test_draws_follow_the_distribution(vocab):
    """One position, many seeds: the tokens' counts are softmax(scores) (chi-square), zeros
    never drawn. Negative control: the same counts against a slightly different law fail."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=generator) * 1.5
    logits[3] = -math.inf
    probs = torch.softmax(logits.double(), dim=0)
    num_draws = 60_000
    seeds = torch.arange(num_draws, dtype=torch.int64) * 7919 + 5
    tokens = gumbel_argmax(logits.expand(num_draws, -1), seeds, torch.full((num_draws,), 42))
    counts = torch.bincount(tokens, minlength=vocab).double()
    stat, dof = chi_square(counts, probs)
    assert stat < critical_0_001(dof), (stat, dof)
    wrong = torch.softmax(logits.double() * 1.1, dim=0)
    stat, dof = chi_square(counts, wrong)
    assert stat > critical_0_001(dof)


def test_noise_is_a_function_of_seed_and_position_only():
    """The same (seed, position) draws the same token in any batch and row; positions and
    seeds each change the draw (here the draws are nearly uniform over 1,000 tokens)."""
    scores = torch.zeros(6, 1000)
    seeds = torch.tensor([11, 11, 11, 12, 11, 12])
    positions = torch.tensor([0, 1, 0, 0, 2, 0])
    tokens = gumbel_argmax(scores, seeds, positions).tolist()
    assert tokens[0] == tokens[2] and tokens[3] == tokens[5]
    assert len({tokens[0], tokens[1], tokens[3], tokens[4]}) == 4
    alone = gumbel_argmax(scores[:1], seeds[1:2], positions[1:2]).tolist()
    assert alone == [tokens[1]]


def test_a_large_seed_and_position_stay_in_range():
    scores = torch.zeros(2, 300)
    seeds = torch.tensor([2**63 - 1, 0])
    positions = torch.tensor([2**31 - 1, 2**40])
    tokens = gumbel_argmax(scores, seeds, positions)
    assert torch.equal(tokens, gumbel_argmax_dense(scores, seeds, positions))
