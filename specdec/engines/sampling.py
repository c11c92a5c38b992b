"""Per-row logit processing and sampling, shared by the draft and the target engine.

"The target distribution" is the target's softmax after the request's own processing
(end token blocked before min_tokens, temperature, top-k, top-p). The draft applies the same
processing to its own logits, which keeps its proposals close to what will be accepted.
Temperature 0 means greedy: the row takes the argmax. A sampled row draws by Gumbel-max
with noise keyed by its seed and position (specdec/engines/coupling.py), so the draft and the
target sample with the same noise and only token ids leave the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engines.coupling import gumbel_argmax


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

    def to(self, device: torch.device | str) -> RowSampling:
        return RowSampling(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def block_end_tokens(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """Sets the end token's logit to -inf on rows that have not reached min_tokens."""
    rows = torch.nonzero(sampling.block_end & (sampling.end_id >= 0)).flatten()
    if rows.numel():
        logits = logits.clone()
        logits[rows, sampling.end_id[rows]] = float("-inf")
    return logits


def sampling_scores(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 log-probabilities of the target distribution up to a
    constant per row: temperature, top-k and top-p applied, filtered tokens -inf.

    Rows must have temperature > 0.
    """
    scores = block_end_tokens(logits.float(), sampling) / sampling.temperature[:, None]
    top_k = sampling.top_k
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, scores.shape[-1]).clamp(max=scores.shape[-1])
        kth = scores.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # (R, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if bool((sampling.top_p < 1).any()):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = mass_before >= sampling.top_p[:, None]  # the first token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def probs_from_logits(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 probabilities of the target distribution (the
    softmax of sampling_scores). Filtered tokens get probability exactly 0."""
    return torch.softmax(sampling_scores(logits, sampling), dim=-1)


def choose_tokens(
    logits: torch.Tensor,  # (R, V)
    sampling: RowSampling,
    seeds: torch.Tensor,  # (R,) int64, each row's sequence's seed
    positions: torch.Tensor,  # (R,) int64, the chosen token's position in its sequence
    log_probs_wanted: torch.Tensor | None = None,  # (R,) bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(R,) int64 tokens on the logits' device: the argmax for greedy rows, a Gumbel-max
    draw keyed by (seed, position) for sampled rows (specdec/engines/coupling.py). With
    log_probs_wanted: also (R,) float32 log-probabilities of the chosen tokens (greedy rows:
    the log-softmax at temperature 1, the end token blocked where required; sampled rows:
    the target distribution's), 0 for rows that did not ask."""
    seeds, positions = seeds.to(logits.device), positions.to(logits.device)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    log_probs = None
    if log_probs_wanted is not None and bool(log_probs_wanted.any()):
        log_probs = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    greedy = sampling.temperature == 0
    for rows, is_greedy in (
        (torch.nonzero(greedy).flatten(), True),
        (torch.nonzero(~greedy).flatten(), False),
    ):
        if not rows.numel():
            continue
        row_sampling = sampling.select(rows)
        # All rows alike (the common case): no copy of the logits.
        row_logits = logits if rows.numel() == logits.shape[0] else logits[rows]
        if is_greedy:
            scores = block_end_tokens(row_logits.float(), row_sampling)
            tokens[rows] = scores.argmax(dim=-1)
        else:
            scores = sampling_scores(row_logits, row_sampling)
            tokens[rows] = gumbel_argmax(scores, seeds[rows], positions[rows])
        if log_probs is not None and log_probs_wanted is not None:
            asked = torch.nonzero(log_probs_wanted[rows]).flatten()
            if asked.numel():
                chosen = torch.log_softmax(scores[asked], dim=-1)
                picked = chosen.gather(-1, tokens[rows[asked]][:, None]).squeeze(-1)
                log_probs[rows[asked]] = picked
    return tokens, log_probs
