"""The distilled draft: its reduced head, exact coupled sampling with its real distribution,
and the transformers wrapper used for assisted generation."""

from __future__ import annotations

import pytest
import torch

from conftest import DRAFT
from specdec.engines.coupling import gumbel_argmax
from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import RowSampling, probs_from_logits
from specdec.loop.verify import verify
from stats import chi_square, critical_0_001


@pytest.fixture(scope="module")
def draft_engine():
    if not (DRAFT / "config.json").exists():
        pytest.fail("models/smollm2-135m-draft missing: run `make models`")
    return LlamaEngine.from_checkpoint(DRAFT, num_slots=2, max_length=128)


def last_logits(engine: LlamaEngine, ids: list[int], slot: int = 0) -> torch.Tensor:
    return engine.forward(torch.tensor(ids), [len(ids)], [slot], [0], [1])[0]


def sampling(temperature: float, top_k: int) -> RowSampling:
    return RowSampling(
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([1.0]),
        torch.tensor([-1]),
        torch.tensor([False]),
    )


def test_draft_scores_only_its_head(draft_engine):
    logits = last_logits(draft_engine, [1, 504, 3575, 282])
    head = draft_engine.head_token_ids
    outside = torch.ones(logits.shape[0], dtype=torch.bool)
    outside[head] = False
    assert torch.isneginf(logits[outside]).all()
    assert torch.isfinite(logits[head]).all()
    probs = probs_from_logits(logits[None], sampling(1.0, 0))[0]
    assert float(probs[outside].sum()) == 0.0


def test_coupled_sampling_with_the_real_draft_reproduces_the_target(draft_engine, target_dir):
    """Real distributions, temperature 0.7 and top-k 6 on both (small supports, so a
    chi-square test can see a wrong rule), k = 1: the draft and the target draw with the
    same keyed noise, verify() accepts the proposal if it is the target's own token, and
    the law of both emitted tokens (the accepted-or-recovered one and the next: the bonus
    when the proposal is accepted) is the target's."""
    target = LlamaEngine.from_checkpoint(target_dir, num_slots=1, max_length=128)
    context = [1, 504, 3575, 282, 4649, 314]
    processing = sampling(0.7, 6)

    def target_row(tokens: list[int]) -> torch.Tensor:
        return probs_from_logits(last_logits(target, tokens)[None], processing)[0]

    first = target_row(context)
    draft_probs = probs_from_logits(last_logits(draft_engine, context)[None], processing)
    assert not torch.allclose(first, draft_probs[0])  # otherwise the test shows nothing
    # The target's next distribution after each token it can emit first.
    after = {int(x): target_row(context + [int(x)]) for x in torch.nonzero(first > 0).flatten()}
    # Only tokens some distribution can produce matter: work on their union (exact).
    reachable = (first > 0) | (draft_probs[0] > 0) | (torch.stack(list(after.values())) > 0).any(0)
    union = torch.nonzero(reachable).flatten()
    small = {int(v): i for i, v in enumerate(union)}  # token -> its index in the union
    first_small, draft_small = first[union], draft_probs[0, union]
    after_small = {small[x]: row[union] for x, row in after.items()}
    cells = [
        (x, int(y)) for x, row in after_small.items() for y in torch.nonzero(row > 0).flatten()
    ]
    index = {cell: i for i, cell in enumerate(cells)}
    expected = torch.tensor([float(first_small[x] * after_small[x][y]) for x, y in cells])

    num_rounds = 20_000
    seeds = torch.arange(num_rounds, dtype=torch.int64) * 31 + 5
    position = len(context)

    def draws(rows: torch.Tensor, offset: int) -> list[int]:
        positions = torch.full((num_rounds,), position + offset)
        return gumbel_argmax(rows.log(), seeds, positions).tolist()

    proposals = draws(draft_small.expand(num_rounds, -1), 0)
    own_first = draws(first_small.expand(num_rounds, -1), 0)
    accepted = 0
    counts = torch.zeros(len(cells))
    verdicts = [verify([p], [t, -1]) for p, t in zip(proposals, own_first, strict=True)]
    # Each round's second token: the target's own draw after its first emitted token.
    seconds = draws(torch.stack([after_small[v.token_ids[0]] for v in verdicts]), 1)
    for verdict, second in zip(verdicts, seconds, strict=True):
        accepted += verdict.num_accepted
        counts[index[(verdict.token_ids[0], second)]] += 1
    stat, dof = chi_square(counts, expected / expected.sum())
    assert dof == len(cells) - 1 and dof >= 20
    assert stat < critical_0_001(dof), (stat, dof)
    assert 0 < accepted < num_rounds


def test_transformers_wrapper_matches_the_engine(draft_engine):
    from build.hf_draft import load_hf_draft

    model = load_hf_draft(DRAFT)
    ids = [1, 504, 3575, 282, 4649, 314]
    with torch.inference_mode():
        hf_logits = model(torch.tensor([ids])).logits[0, -1]
    engine_logits = last_logits(draft_engine, ids, slot=1)
    finite = torch.isfinite(engine_logits)
    assert torch.equal(finite, torch.isfinite(hf_logits))
    assert torch.allclose(hf_logits[finite], engine_logits[finite], atol=1e-3)
