"""The distilled draft: its reduced head, exact sampling with its real distribution, and the
transformers wrapper used for assisted generation."""

from __future__ import annotations

import pytest
import torch

from conftest import DRAFT
from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import RowSampling, probs_from_logits, sample_token
from specdec.loop.rejection import rejection_sample
from stats import CHI2_CRITICAL_0_001, chi_square


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


def test_rejection_with_the_real_draft_reproduces_the_target(draft_engine, target_dir):
    """Real distributions at one context, temperature 0.7 and top-k 6 on both (a small
    support, so a chi-square test can see a wrong rule)."""
    target = LlamaEngine.from_checkpoint(target_dir, num_slots=1, max_length=128)
    context = [1, 504, 3575, 282, 4649, 314]
    processing = sampling(0.7, 6)
    target_probs = probs_from_logits(last_logits(target, context)[None], processing)[0]
    draft_probs = probs_from_logits(last_logits(draft_engine, context)[None], processing)[0]
    assert not torch.allclose(target_probs, draft_probs)  # otherwise the test shows nothing
    # Only tokens either distribution can produce matter: work on their union (exact).
    union = torch.nonzero((target_probs > 0) | (draft_probs > 0)).flatten()
    target_small, draft_small = target_probs[union], draft_probs[union]
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(len(union))
    for _ in range(20_000):
        proposal = sample_token(draft_small, generator)
        verdict = rejection_sample(
            [proposal], draft_small[None], target_small[None].repeat(2, 1), generator
        )
        counts[verdict.token_ids[0]] += 1
    stat, dof = chi_square(counts, target_small)
    assert dof == 5
    assert stat < CHI2_CRITICAL_0_001[5]


def test_transformers_wrapper_matches_the_engine(draft_engine):
    from specdec.engines.hf_draft import load_hf_draft

    model = load_hf_draft(DRAFT)
    ids = [1, 504, 3575, 282, 4649, 314]
    with torch.inference_mode():
        hf_logits = model(torch.tensor([ids])).logits[0, -1]
    engine_logits = last_logits(draft_engine, ids, slot=1)
    finite = torch.isfinite(engine_logits)
    assert torch.equal(finite, torch.isfinite(hf_logits))
    assert torch.allclose(hf_logits[finite], engine_logits[finite], atol=1e-3)
