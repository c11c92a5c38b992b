"""Verification with Gumbel-coupled sampling reproduces the target (arXiv 2408.07978).

A toy language model over 3 tokens: each position's distribution is one of four rows, chosen
by the position and the token before it, so the law of a whole round is a product of
different conditionals. The round is played with the real pieces: the draft and the target
draw with specdec/engines/coupling.py's noise, the loop's verify() decides, and a round that
stops early is completed from the target at the following positions, as the next rounds
would be. Every emitted token, the bonus included, must follow the target's law, the output
must be the target's own sampling with the same seed whoever proposed, and a model draft
must be accepted as often as the coupling promises.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.engines.coupling import gumbel_argmax
from specdec.loop.verify import Verdict, verify
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
def test_verify_accepts_the_prefix_equal_to_the_targets_tokens(draft, target, expected):
    assert verify(draft, target) == expected


VOCAB = 3
TARGET_ROWS = torch.tensor(
    [
        [0.50, 0.30, 0.20],
        [0.20, 0.30, 0.50],
        [0.00, 0.60, 0.40],  # a zero: as after top-k / top-p
        [0.35, 0.35, 0.30],
    ],
    dtype=torch.float64,
)
DRAFT_ROWS = torch.tensor(
    [
        [0.20, 0.20, 0.60],
        [0.60, 0.20, 0.20],
        [0.30, 0.00, 0.70],  # proposes token 0 where the target's row may never emit it
        [0.40, 0.30, 0.30],
    ],
    dtype=torch.float64,
)
# A model-free proposal (prompt lookup): the same tokens every round, no distribution. Its
# third token follows a 0, where the target's row is the one that never emits 0.
POINT_MASS = [2, 0, 0, 1]


def row_index(prefix: list[int]) -> int:
    """Which row gives the next token's distribution after `prefix` (the tokens so far)."""
    previous = prefix[-1] if prefix else 0
    return (len(prefix) + 2 * previous) % len(TARGET_ROWS)


def draw(table: torch.Tensor, prefixes: list[list[int]], seeds, positions) -> list[int]:
    """One Gumbel-max draw per round, after its prefix, with its seed's noise at `positions`."""
    rows = table[[row_index(p) for p in prefixes]]
    return gumbel_argmax(rows.log(), seeds, positions).tolist()


def target_tokens(prefixes: list[list[int]], seeds, shift: int = 0) -> list[list[int]]:
    """The target's own token after every prefix of each proposal, as the target call
    returns them: at position i after proposal[:i] (`shift` moves the noise's position, a
    planted bug)."""
    k = len(prefixes[0])
    columns = [
        draw(TARGET_ROWS, [p[:i] for p in prefixes], seeds, torch.full_like(seeds, i + shift))
        for i in range(k + 1)
    ]
    return [list(row) for row in zip(*columns, strict=True)]


def plain_sampling(seeds, length: int) -> list[list[int]]:
    """The target alone, one token at a time, with the same noise."""
    outputs: list[list[int]] = [[] for _ in seeds]
    for i in range(length):
        for out, token in zip(
            outputs, draw(TARGET_ROWS, outputs, seeds, torch.full_like(seeds, i)), strict=True
        ):
            out.append(token)
    return outputs


def proposals(proposer: str, k: int, seeds, noise_offset: int = 0) -> list[list[int]]:
    """k proposed tokens per round: the draft model's draws with the rounds' noise (or
    with other noise, `noise_offset`), or prompt lookup's fixed tokens."""
    if proposer == "point_mass":
        return [POINT_MASS[:k] for _ in seeds]
    drafted: list[list[int]] = [[] for _ in seeds]
    for i in range(k):
        positions = torch.full_like(seeds, i) + noise_offset
        for out, token in zip(drafted, draw(DRAFT_ROWS, drafted, seeds, positions), strict=True):
            out.append(token)
    return drafted


def play(k: int, proposer: str, num_rounds: int, seed: int, rule=verify, shift: int = 0):
    """Emitted tokens of each round (completed to k + 1) and each verdict."""
    seeds = torch.arange(num_rounds, dtype=torch.int64) + seed * 1_000_003
    proposed = proposals(proposer, k, seeds)
    verdicts = [
        rule(p, t) for p, t in zip(proposed, target_tokens(proposed, seeds, shift), strict=True)
    ]
    emitted = [list(v.token_ids) for v in verdicts]
    for length in range(1, k + 1):  # rounds that stopped early: the next rounds' tokens
        short = [i for i, e in enumerate(emitted) if len(e) == length]
        if short:
            picked = seeds[short]
            tokens = draw(
                TARGET_ROWS,
                [emitted[i] for i in short],
                picked,
                torch.full_like(picked, length + shift),
            )
            for i, token in zip(short, tokens, strict=True):
                emitted[i].append(token)
    return emitted, verdicts, seeds


def target_law(length: int) -> torch.Tensor:
    """P(x_0 .. x_{length-1}) for every sequence, flattened in base VOCAB (x_0 first)."""
    probs = []
    for sequence in itertools.product(range(VOCAB), repeat=length):
        p = 1.0
        for i, token in enumerate(sequence):
            p *= float(TARGET_ROWS[row_index(list(sequence[:i])), token])
        probs.append(p)
    return torch.tensor(probs, dtype=torch.float64)


def chi_square_against_target(emitted: list[list[int]], k: int) -> tuple[float, float]:
    counts = torch.zeros(VOCAB ** (k + 1), dtype=torch.float64)
    for tokens in emitted:
        counts[sum(t * VOCAB ** (k - i) for i, t in enumerate(tokens))] += 1
    stat, dof = chi_square(counts, target_law(k + 1))
    return stat, critical_0_001(dof)


@pytest.mark.parametrize("proposer", ["model", "point_mass"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_emitted_token_follows_the_target(k, proposer):
    """The joint law of all k + 1 tokens of a round, the bonus included, is the target's,
    and each round's tokens are plain sampling's with its seed: the proposer changes
    nothing but how many tokens a target pass yields."""
    emitted, verdicts, seeds = play(k, proposer, 20_000, seed=k)
    stat, critical = chi_square_against_target(emitted, k)
    assert stat < critical, (stat, critical)
    assert emitted == plain_sampling(seeds, k + 1)
    assert 0 < sum(v.num_accepted for v in verdicts) < k * len(verdicts)


def always_accept(draft_ids, target_ids) -> Verdict:
    """A planted bug: keep every proposed token, then the target's last."""
    return Verdict(len(draft_ids), list(draft_ids) + [target_ids[-1]])


def proposal_kept_at_the_mismatch(draft_ids, target_ids) -> Verdict:
    """A planted bug: the proposed token kept where it differs from the target's."""
    verdict = verify(draft_ids, target_ids)
    if verdict.num_accepted == len(draft_ids):
        return verdict
    return Verdict(verdict.num_accepted + 1, list(draft_ids[: verdict.num_accepted + 1]))


@pytest.mark.parametrize(
    ("rule", "shift"),
    [(always_accept, 0), (proposal_kept_at_the_mismatch, 0), (verify, 1)],
    ids=["always-accept", "proposal-kept", "noise-of-the-next-position"],
)
@pytest.mark.parametrize("proposer", ["model", "point_mass"])
def test_wrong_rules_fail_the_same_check(rule, shift, proposer):
    """Negative controls: the same check fails for wrong rules, and for the target's noise
    taken at the wrong position (then a round's tokens are no longer plain sampling's)."""
    emitted, _, seeds = play(2, proposer, 5_000, seed=2, rule=rule, shift=shift)
    if shift:
        assert emitted != plain_sampling(seeds, 3)
        return
    try:
        stat, critical = chi_square_against_target(emitted, 2)
    except AssertionError as error:  # a token of target probability 0 was emitted
        assert "probability 0" in str(error)
        return
    assert stat > critical, (stat, critical)


def coupling_acceptance(target: torch.Tensor, draft: torch.Tensor) -> float:
    """P(the two Gumbel-max draws agree) = sum_x 1 / sum_y max(p_y/p_x, q_y/q_x)."""
    total = 0.0
    for x in range(len(target)):
        if target[x] > 0 and draft[x] > 0:
            total += 1 / float(torch.maximum(target / target[x], draft / draft[x]).sum())
    return total


def test_a_model_draft_is_accepted_as_the_coupling_promises():
    """First-token acceptance of the model draft: the coupling's probability, at least
    (1 - d)/(1 + d); a draft that drew with noise of its own (a planted bug) is accepted
    only sum_x p(x) q(x) of the time."""
    num_rounds = 40_000
    seeds = torch.arange(num_rounds, dtype=torch.int64)
    target, draft = TARGET_ROWS[0], DRAFT_ROWS[0]
    promised = coupling_acceptance(target, draft)
    distance = 0.5 * float((target - draft).abs().sum())
    assert promised >= (1 - distance) / (1 + distance)
    tolerance = 4.5 * (promised * (1 - promised) / num_rounds) ** 0.5
    first = torch.tensor([p[0] for p in proposals("model", 1, seeds)])
    own = torch.tensor([t[0] for t in target_tokens([[]] * num_rounds, seeds)])
    assert abs(float((first == own).double().mean()) - promised) < tolerance
    independent = torch.tensor([p[0] for p in proposals("model", 1, seeds, noise_offset=7)])
    independent_rate = float((independent == own).double().mean())
    assert abs(independent_rate - float((target * draft).sum())) < 0.02
    assert independent_rate < promised - 0.05


def test_a_point_mass_is_accepted_with_the_target_probability():
    num_rounds = 20_000
    seeds = torch.arange(num_rounds, dtype=torch.int64) + 77
    own = [t[0] for t in target_tokens([[]] * num_rounds, seeds)]
    assert abs(sum(t == 0 for t in own) / num_rounds - float(TARGET_ROWS[0, 0])) < 0.02
    never = draw(TARGET_ROWS, [[0, 0]] * 200, seeds[:200], torch.full((200,), 2))
    assert 0 not in never  # the row after [0, 0] never emits 0


def test_an_identical_draft_is_always_accepted():
    seeds = torch.arange(500, dtype=torch.int64)
    proposed = [
        p[:3] for p in plain_sampling(seeds, 3)
    ]  # what the target itself samples, proposed with its own noise
    for p, t in zip(proposed, target_tokens(proposed, seeds), strict=True):
        assert verify(p, t).num_accepted == 3
