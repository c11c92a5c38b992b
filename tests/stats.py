"""Pearson's chi-square test for sampled token counts."""

from __future__ import annotations

import math

import torch

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_0_001 = {4: 18.467, 5: 20.515, 8: 26.124, 29: 58.301, 80: 124.839}
Z_0_001 = 3.090232  # the standard normal's upper 0.1% point


def critical_0_001(dof: int) -> float:
    """The upper 0.1% point: from the table, else Wilson and Hilferty's cube-root
    approximation (within 2% of the exact value from 4 degrees of freedom up)."""
    if dof in CHI2_CRITICAL_0_001:
        return CHI2_CRITICAL_0_001[dof]
    h = 2 / (9 * dof)
    return dof * (1 - h + Z_0_001 * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells with nonzero expected mass; and its dof."""
    total = counts.sum()
    expected = probs * total
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(stat), int(support.sum()) - 1
