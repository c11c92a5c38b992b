"""Per-row logit processing and sampling, shared by the draft and the target engine.

"The target distribution" is the target's softmax after the request's own processing
(end token blocked before min_tokens, temperature, top-k, top-p). The draft applies the same
processing to its own logits, which keeps its proposals close to what will be accepted.
Temperature 0 means greedy: the row takes the argmax and no probabilities are returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling parameters of the rows of one engine call, one entry per logits row."""

    temperature: torch.Tensor  # (R,) float32, 0 = greedy
    top_k: torch.Tensor  # (R,) int64, 0 = off
    top_p: torch.Tensor  # (R,) float32, 1 = off
    end_id: torch.Tensor  # (R,) int64, -1 = none
    block_end: torch.Tensor  # (R,) bool: the end token may not be produced here

    def select(self, rows: torch.Tensor) -> RowSampling:
        return RowSampling(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


def block_end_tokens(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """Sets the end token's logit to -inf on rows that have not reached min_tokens."""
    rows = torch.nonzero(sampling.block_end & (sampling.end_id >= 0)).flatten()
    if rows.numel():
        logits = logits.clone()
        logits[rows, sampling.end_id[rows]] = float("-inf")
    return logits


def probs_from_logits(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 probabilities after temperature, top-k and top-p.

    Rows must have temperature > 0. Filtered tokens get probability exactly 0.
    """
    logits = block_end_tokens(logits.float(), sampling)
    logits = logits / sampling.temperature[:, None]
    top_k = sampling.top_k
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(-1, (k - 1)[:, None])  # (R, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if bool((sampling.top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = mass_before >= sampling.top_p[:, None]  # the first token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """(R, V) logits -> (R,) argmax token ids, the end token blocked where required."""
    return block_end_tokens(logits, sampling).argmax(dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from a (V,) distribution with the row's own generator."""
    return int(torch.multinomial(probs, 1, generator=generator))
