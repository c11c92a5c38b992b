"""Per-row logit processing and sampling, shared by the draft and the target engine.

"The target distribution" is the target's softmax after the request's own processing
(its logit controls, specdec/engines/controls.py; the end token blocked before min_tokens;
temperature, top-k, top-p, min_p). The draft applies the same
processing to its own logits, which keeps its proposals close to what will be accepted.
Temperature 0 means greedy: the row takes the argmax. A sampled row draws by Gumbel-max
with noise keyed by its seed and position (specdec/engines/coupling.py), so the draft and the
target sample with the same noise and only token ids leave the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specdec.engines.coupling import gumbel_argmax, gumbel_argmax_dense


@dataclass
class RowSampling:
    """Sampling parameters of the rows of one engine call, one entry per logits row."""

    temperature: torch.Tensor  # (R,) float32, 0 = greedy
    top_k: torch.Tensor  # (R,) int64, 0 = off
    top_p: torch.Tensor  # (R,) float32, 1 = off
    end_id: torch.Tensor  # (R,) int64, -1 = none
    block_end: torch.Tensor  # (R,) bool: the end token may not be produced here
    min_p: torch.Tensor | None = None  # (R,) float32, 0 = off; None: no row uses it

    def select(self, rows: torch.Tensor) -> RowSampling:
        return RowSampling(*(self._field(f, lambda t: t[rows]) for f in self.__dataclass_fields__))

    def to(self, device: torch.device | str) -> RowSampling:
        return RowSampling(
            *(self._field(f, lambda t: t.to(device)) for f in self.__dataclass_fields__)
        )

    def _field(self, name: str, change):
        value = getattr(self, name)
        return None if value is None else change(value)


def block_end_tokens(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """Sets the end token's logit to -inf on rows that have not reached min_tokens."""
    rows = torch.nonzero(sampling.block_end & (sampling.end_id >= 0)).flatten()
    if rows.numel():
        logits = logits.clone()
        logits[rows, sampling.end_id[rows]] = float("-inf")
    return logits


def block_end_tokens_dense(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """block_end_tokens without reading the device (a CUDA graph): every row's end logit is
    rewritten, to itself where it is not blocked."""
    blocked = sampling.block_end & (sampling.end_id >= 0)  # (R,)
    end_ids = sampling.end_id.clamp(min=0)[:, None]  # (R, 1)
    kept = logits.gather(1, end_ids)
    return logits.scatter(1, end_ids, kept.masked_fill(blocked[:, None], float("-inf")))


@dataclass(frozen=True)
class Filters:
    """Which filters a call runs, decided without reading the device (a CUDA graph fixes
    them): top_k_size, the width of the top-k that finds each row's k-th score (0: no row
    uses top-k); top_p, whether some row uses top-p."""

    top_k_size: int
    top_p: bool
    min_p: bool = False  # some row uses min_p (eager calls only: controlled rows)


def read_filters(sampling: RowSampling, vocab_size: int) -> Filters:
    """The filters of `sampling`'s rows, read from the device (eager calls)."""
    size = int(sampling.top_k.max().clamp(min=0, max=vocab_size)) if len(sampling.top_k) else 0
    min_p = sampling.min_p is not None and bool((sampling.min_p > 0).any())
    return Filters(size, bool((sampling.top_p < 1).any()), min_p)


def sampling_scores(
    logits: torch.Tensor, sampling: RowSampling, filters: Filters | None = None
) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 log-probabilities of the target distribution up to a
    constant per row: temperature, top-k, top-p and min_p applied, filtered tokens -inf.

    Rows must have temperature > 0. filters None: read from `sampling` (read_filters);
    given, nothing here reads the device, so a CUDA graph can capture it.
    """
    dense = filters is not None
    filters = filters or read_filters(sampling, logits.shape[-1])
    block = block_end_tokens_dense if dense else block_end_tokens
    scores = block(logits.float(), sampling) / sampling.temperature[:, None]
    if filters.top_k_size:
        k = torch.where(sampling.top_k > 0, sampling.top_k, scores.shape[-1])
        k = k.clamp(max=filters.top_k_size)  # rows without top-k keep every token
        top = scores.topk(filters.top_k_size, dim=-1).values
        kth = top.gather(-1, (k - 1)[:, None])  # (R, 1)
        kth = kth.masked_fill((sampling.top_k <= 0)[:, None], float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if filters.top_p:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = mass_before >= sampling.top_p[:, None]  # the first token always stays
        # top_p 1 is off: rounding must not drop a tail token whose mass before reads 1
        drop_sorted &= (sampling.top_p < 1)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if filters.min_p and sampling.min_p is not None:
        # min_p: a token stays if its probability is at least min_p times the best one's.
        best = scores.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(scores < best + sampling.min_p.log()[:, None], float("-inf"))
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


def choose_tokens_dense(
    logits: torch.Tensor,  # (R, V)
    sampling: RowSampling,
    seeds: torch.Tensor,  # (R,) int64
    positions: torch.Tensor,  # (R,) int64
    filters: Filters | None,  # None: every row is greedy
) -> torch.Tensor:
    """(R,) int64: choose_tokens' tokens, bit for bit, with work that does not depend on
    the values (a CUDA graph captures it): every row is scored both ways and keeps its own,
    and sampled rows make all their noise (gumbel_argmax_dense)."""
    blocked = block_end_tokens_dense(logits.float(), sampling)
    greedy_tokens = blocked.argmax(dim=-1)
    if filters is None:
        return greedy_tokens
    sampled = sampling.temperature > 0
    # A greedy row's temperature 0 would make its unused scores NaN.
    temperature = torch.where(sampled, sampling.temperature, 1.0)
    unit = replace(sampling, temperature=temperature)
    scores = sampling_scores(logits, unit, filters)
    drawn = gumbel_argmax_dense(scores, seeds, positions)
    return torch.where(sampled, drawn, greedy_tokens)
