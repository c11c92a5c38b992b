"""Rejection sampling reproduces the target distribution (arXiv 2211.17192, Theorem 1)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.engines.sampling import sample_token
from specdec.loop.rejection import Verdict, rejection_sample, verify_greedy
from stats import chi_square, critical_0_001


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


# A toy language model over 3 tokens: the distribution of the token at `position` is one of
# four rows, chosen by the position and the token before it. The law of a whole sequence is
# then a product of different conditionals, so a token drawn from the wrong position's row
# (a bonus from target_probs[k - 1]) or after the wrong prefix changes it.
VOCAB = 3
TARGET_ROWS = torch.tensor(
    [
        [0.50, 0.30, 0.20],
        [0.20, 0.30, 0.50],
        [0.00, 0.60, 0.40],  # a zero: as after top-k / top-p
        [0.35, 0.35, 0.30],
    ]
)
DRAFT_ROWS = torch.tensor(
    [
        [0.20, 0.20, 0.60],
        [0.60, 0.20, 0.20],
        [0.30, 0.00, 0.70],  # proposes token 0 where the target's row may never emit it
        [0.40, 0.30, 0.30],
    ]
)
# A model-free proposal (prompt lookup): the same tokens every round, no distribution. Its
# third token follows a 0, where the target's row is the one that never emits 0.
POINT_MASS = [2, 0, 0, 1]


def row_index(prefix: list[int]) -> int:
    """Which row gives the next token's distribution after `prefix` (the tokens so far)."""
    previous = prefix[-1] if prefix else 0
    return (len(prefix) + 2 * previous) % len(TARGET_ROWS)


def row_of(table: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    return table[row_index(prefix)]


def rows_along(table: torch.Tensor, tokens: list[int], count: int) -> torch.Tensor:
    """(count, VOCAB): the distributions after tokens[:0], tokens[:1], ..."""
    return table[[row_index(tokens[:i]) for i in range(count)]]


CDF = {"target": TARGET_ROWS.cumsum(1).tolist(), "draft": DRAFT_ROWS.cumsum(1).tolist()}


def draw(model: str, prefix: list[int], uniform: float) -> int:
    """Inverse-CDF draw of the next token (one of probability 0 is never drawn)."""
    cdf = CDF[model][row_index(prefix)]
    return min(sum(c <= uniform for c in cdf), VOCAB - 1)


def target_law(length: int) -> torch.Tensor:
    """P(x_0 .. x_{length-1}) for every sequence, flattened in base VOCAB (x_0 first)."""
    probs = []
    for sequence in itertools.product(range(VOCAB), repeat=length):
        p = 1.0
        for i, token in enumerate(sequence):
            p *= float(row_of(TARGET_ROWS, list(sequence[:i]))[token])
        probs.append(p)
    return torch.tensor(probs, dtype=torch.float64)


def emitted_counts(rule, k: int, proposer: str, num_draws: int, seed: int) -> torch.Tensor:
    """Counts of all k + 1 tokens of speculate-verify rounds at k (the bonus included). A
    round that stops early at a rejection is completed from the target, as the next
    rounds would be."""
    generator = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(num_draws, 2 * k + 1, generator=generator, dtype=torch.float64)
    counts = torch.zeros(VOCAB ** (k + 1), dtype=torch.float64)
    for n in range(num_draws):
        u = uniforms[n].tolist()
        if proposer == "model":
            draft_ids: list[int] = []
            for i in range(k):
                draft_ids.append(draw("draft", draft_ids, u[i]))
            draft_probs = rows_along(DRAFT_ROWS, draft_ids, k)
        else:
            draft_ids, draft_probs = POINT_MASS[:k], None
        target_probs = rows_along(TARGET_ROWS, draft_ids, k + 1)
        emitted = list(rule(draft_ids, draft_probs, target_probs, generator).token_ids)
        while len(emitted) < k + 1:
            emitted.append(draw("target", emitted, u[k + len(emitted)]))
        counts[sum(t * VOCAB ** (k - i) for i, t in enumerate(emitted))] += 1
    return counts


def chi_square_against_target(counts: torch.Tensor, k: int) -> tuple[float, float]:
    stat, dof = chi_square(counts, target_law(k + 1))
    return stat, critical_0_001(dof)


@pytest.mark.parametrize("proposer", ["model", "point_mass"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_emitted_token_follows_the_target(k, proposer):
    """The joint law of all k + 1 tokens of a round, the bonus included, is the target's."""
    counts = emitted_counts(rejection_sample, k, proposer, 20_000, seed=k)
    stat, critical = chi_square_against_target(counts, k)
    assert stat < critical, (stat, critical)


def bonus_from_the_previous_position(draft_ids, draft_probs, target_probs, generator):
    """A planted bug: the bonus drawn from the last draft position's distribution."""
    k = len(draft_ids)
    shifted = torch.cat([target_probs[:k], target_probs[k - 1 : k]])
    return rejection_sample(draft_ids, draft_probs, shifted, generator)


def one_more_accepted(draft_ids, draft_probs, target_probs, generator):
    """A planted bug: the draft token at the first rejection kept as well."""
    verdict = rejection_sample(draft_ids, draft_probs, target_probs, generator)
    if verdict.num_accepted == len(draft_ids):
        return verdict
    kept = list(draft_ids[: verdict.num_accepted + 1])
    return Verdict(verdict.num_accepted + 1, kept)


@pytest.mark.parametrize(
    "rule", [bonus_from_the_previous_position, one_more_accepted, always_accept]
)
@pytest.mark.parametrize("proposer", ["model", "point_mass"])
def test_wrong_rules_fail_the_same_check(rule, proposer):
    counts = emitted_counts(rule, 2, proposer, 5_000, seed=2)
    try:
        stat, critical = chi_square_against_target(counts, 2)
    except AssertionError as error:  # a token of target probability 0 was emitted
        assert "probability 0" in str(error)
        return
    assert stat > critical, (stat, critical)


def test_identical_draft_is_always_accepted():
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        draft_ids: list[int] = []
        for _ in range(3):
            draft_ids.append(sample_token(row_of(TARGET_ROWS, draft_ids), generator))
        target_probs = rows_along(TARGET_ROWS, draft_ids, 4)
        verdict = rejection_sample(draft_ids, target_probs[:3], target_probs, generator)
        assert verdict.num_accepted == 3
        assert len(verdict.token_ids) == 4


def test_seeded_rejection_is_deterministic():
    target_probs = rows_along(TARGET_ROWS, [2, 0], 3)
    draft_probs = rows_along(DRAFT_ROWS, [2, 0], 2)

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [
            rejection_sample([2, 0], draft_probs, target_probs, generator).token_ids
            for _ in range(50)
        ]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_point_mass_accepts_with_the_target_probability():
    generator = torch.Generator().manual_seed(9)
    target_probs = torch.stack([TARGET_ROWS[0], TARGET_ROWS[1]])
    accepted = sum(
        rejection_sample([0], None, target_probs, generator).num_accepted for _ in range(20_000)
    )
    assert abs(accepted / 20_000 - float(TARGET_ROWS[0, 0])) < 0.02
    never = torch.stack([TARGET_ROWS[2], TARGET_ROWS[0]])  # token 0 has probability 0
    verdict = rejection_sample([0], None, never, generator)
    assert verdict.num_accepted == 0 and verdict.token_ids[0] != 0
