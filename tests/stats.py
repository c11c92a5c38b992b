"""Pearson's chi-square test for sampled token counts."""

from __future__ import annotations

import torch

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_0_001 = {4: 18.467, 5: 20.515, 29: 58.301}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with nonzero expected mass; and its dof."""
    total = counts.sum()
    expected = probs * total
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(stat), int(support.sum()) - 1
