"""Rejection sampling reproduces the target distribution (arXiv 2211.17192, Theorem 1)."""

from __future__ import annotations

import pytest
import torch

from specdec.engines.sampling import sample_token
from specdec.loop.rejection import Verdict, rejection_sample, verify_greedy
from stats import CHI2_CRITICAL_0_001, chi_square


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([], [7], Verdict(0, [7])),
        ([1, 2, 3], [1, 2, 3, 4], Verdict(3, [1, 2, 3, 4])),
        ([1, 2, 3], [1, 9, 3, 4], Verdict(1, [1, 9])),
        ([5, 2], [6, 2, 1], Verdict(0, [6])),
    ],
)
def test_verify_greedy(draft, target, expected):
    assert verify_greedy(draft, target) == expected


def always_accept(draft_ids, draft_probs, target_probs, generator) -> Verdict:
    """A wrong rule: keep every draft token, then a bonus token."""
    return Verdict(len(draft_ids), list(draft_ids) + [sample_token(target_probs[-1], generator)])


def joint_counts(rule, draft_probs, target_probs, num_draws: int, seed: int) -> torch.Tensor:
    """Counts of the first two emitted tokens over many speculate-verify rounds with k = 2."""
    vocab = target_probs.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab * vocab)
    for _ in range(num_draws):
        draft_ids = [sample_token(draft_probs[i], generator) for i in range(2)]
        emitted = rule(draft_ids, draft_probs, target_probs, generator).token_ids
        if len(emitted) < 2:  # rejected at the first position: draw the next from the target
            emitted = emitted + [sample_token(target_probs[1], generator)]
        counts[emitted[0] * vocab + emitted[1]] += 1
    return counts


# The target depends on position only, so its joint law of two tokens is an outer product.
TARGET_PROBS = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.10, 0.10, 0.00],  # a zero: as after top-k / top-p
        [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ]
)
DRAFT_PROBS = torch.tensor(
    [
        [0.10, 0.10, 0.30, 0.10, 0.20, 0.20],  # proposes a token the target never emits
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)


def test_rejection_sampling_matches_target_distribution():
    counts = joint_counts(rejection_sample, DRAFT_PROBS, TARGET_PROBS, 40_000, seed=1)
    expected = torch.outer(TARGET_PROBS[0], TARGET_PROBS[1]).flatten()
    stat, dof = chi_square(counts, expected)
    assert dof == 29
    assert stat < CHI2_CRITICAL_0_001[29]


def test_wrong_rule_fails_the_same_check():
    counts = joint_counts(always_accept, DRAFT_PROBS, TARGET_PROBS, 40_000, seed=1)
    expected = torch.outer(TARGET_PROBS[0], TARGET_PROBS[1]).flatten()
    with pytest.raises(AssertionError, match="probability 0"):
        chi_square(counts, expected)
    support = expected > 0
    stat = float(
        (
            (counts[support] - expected[support] * counts.sum()) ** 2
            / (expected[support] * counts.sum())
        ).sum()
    )
    assert stat > CHI2_CRITICAL_0_001[29]


def test_first_token_marginal_with_k1():
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(6)
    for _ in range(20_000):
        draft_id = sample_token(DRAFT_PROBS[0], generator)
        verdict = rejection_sample([draft_id], DRAFT_PROBS[:1], TARGET_PROBS[:2], generator)
        counts[verdict.token_ids[0]] += 1
    stat, dof = chi_square(counts, TARGET_PROBS[0])
    assert dof == 4
    assert stat < CHI2_CRITICAL_0_001[4]


def test_identical_draft_is_always_accepted():
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        draft_ids = [sample_token(TARGET_PROBS[i], generator) for i in range(2)]
        verdict = rejection_sample(draft_ids, TARGET_PROBS[:2], TARGET_PROBS, generator)
        assert verdict.num_accepted == 2
        assert len(verdict.token_ids) == 3


def test_seeded_rejection_is_deterministic():
    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [
            rejection_sample([2, 0], DRAFT_PROBS, TARGET_PROBS, generator).token_ids
            for _ in range(50)
        ]

    assert run(11) == run(11)
    assert run(11) != run(12)


def point_mass_counts(draft_ids: list[int], num_draws: int, seed: int) -> torch.Tensor:
    """Like joint_counts, for a model-free proposer: the same proposal every round, no
    draft distribution (a point mass on each proposed token)."""
    vocab = TARGET_PROBS.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab * vocab)
    for _ in range(num_draws):
        emitted = rejection_sample(draft_ids, None, TARGET_PROBS, generator).token_ids
        if len(emitted) < 2:
            emitted = emitted + [sample_token(TARGET_PROBS[1], generator)]
        counts[emitted[0] * vocab + emitted[1]] += 1
    return counts


@pytest.mark.parametrize(
    "draft_ids",
    [
        [0, 3],  # the target's likeliest first token, then a likely one
        [5, 2],  # a first token the target never emits: always rejected
        [4, 5],  # a second token the target never emits
    ],
)
def test_point_mass_proposals_keep_the_target_distribution(draft_ids):
    counts = point_mass_counts(draft_ids, 40_000, seed=5)
    expected = torch.outer(TARGET_PROBS[0], TARGET_PROBS[1]).flatten()
    stat, dof = chi_square(counts, expected)
    assert dof == 29
    assert stat < CHI2_CRITICAL_0_001[29]


def test_point_mass_accepts_with_the_target_probability():
    generator = torch.Generator().manual_seed(9)
    accepted = sum(
        rejection_sample([0], None, TARGET_PROBS[:2], generator).num_accepted for _ in range(20_000)
    )
    assert abs(accepted / 20_000 - float(TARGET_PROBS[0, 0])) < 0.02
    never = rejection_sample([5], None, TARGET_PROBS[:2], generator)
    assert never.num_accepted == 0 and never.token_ids[0] != 5
