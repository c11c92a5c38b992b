"""Sampling by Gumbel-max with noise keyed by (seed, position, token id).

A sampled row's token at a position is argmax over tokens x of (log p(x) + g(x)), where the
g(x) are independent standard Gumbel variables: an exact draw from p. Here g is a fixed
function of the request's seed, the token's position in the sequence and x (a counter-based
hash, no generator state), so:
- the target's token at a position depends only on the seed and the target's distribution
  there: the output does not depend on who proposed what (drafter-invariant);
- the draft samples its proposals with the same noise, so a proposal is accepted exactly
  when it equals the target's own token. For a model draft with distribution q at the same
  position, that happens with probability sum_x 1 / sum_y max(p(y)/p(x), q(y)/q(x)), which
  is at least (1 - d)/(1 + d), d the total-variation distance (Daliri, Musco, Suresh,
  "Coupling without communication and drafter-invariant speculative decoding",
  arXiv 2408.07978). A point-mass proposal x (prompt lookup) is accepted with probability
  p(x), as with rejection sampling.
No distribution leaves an engine: each samples where its logits are and returns token ids.

How the noise is made, so that most of it need not be: g(x) = -log(e(x)) with e(x)
independent Exp(1). The vocabulary is cut into blocks of BLOCK tokens. For each block the
hash gives the block's smallest exponential, Exp(1)/BLOCK, and which token holds it
(uniform); every other token of the block holds that minimum plus an Exp(1) of its own
(memorylessness: given the minimum, the others are the minimum plus independent Exp(1)).
That is exactly BLOCK independent Exp(1) variables. Then a block cannot win unless its best
score plus its largest noise reaches the best value found so far, and only such blocks need
their tokens' noise (`gumbel_argmax`). `gumbel_argmax_dense` makes all of it: the same
tokens, bit for bit (tests/test_coupling.py).

The hash keeps every intermediate below 2**63 (31-bit multipliers on 32-bit values), so
int64 arithmetic gives the same bits on every device and never overflows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF
MULTIPLIER = 0x045D9F3B  # < 2**31: a 32-bit value times it stays below 2**63
POSITION_SALT = 0x2545F491
MULTIPLIER_SALT = 0x1B873593
BLOCK_SALT = 0x68E31DA4
BLOCK = 64  # tokens per block; a power of two below 2**8 (the winner index takes low bits)


def mix32(h: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of 32-bit values held in int64 (bijective on [0, 2**32))."""
    h = ((h ^ (h >> 16)) * MULTIPLIER) & MASK32
    h = ((h ^ (h >> 16)) * MULTIPLIER) & MASK32
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R,) int64 seeds and positions -> two (R,) keys in [0, 2**32): an odd multiplier and
    an offset that together pick the row's noise."""
    h = mix32((positions & MASK32) ^ POSITION_SALT)
    h = mix32(h ^ (seeds & MASK32))
    offset = mix32(h ^ ((seeds >> 32) & MASK32))
    multiplier = (mix32(offset ^ MULTIPLIER_SALT) & 0x7FFFFFFF) | 1
    return multiplier, offset


def _hash(keys: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, salt: int) -> torch.Tensor:
    """(R,) keys and (R, N) non-negative ids below 2**32 -> (R, N) 32-bit hashes. A
    different multiplier per row: no row's hashes are a permutation of another's."""
    multiplier, offset = keys
    return mix32(((ids * multiplier[:, None]) & MASK32) ^ offset[:, None] ^ salt)


def _exponential(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> Exp(1) float32, from a uniform in (0, 1) of 24 bits."""
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (2.0**-24)
    return -torch.log(uniform)


def _blocks(keys, num_blocks: int, num_rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's smallest exponential (R, NB) float32 and the index in the block of the
    token that holds it (R, NB) int64."""
    ids = torch.arange(num_blocks, dtype=torch.int64, device=device).expand(num_rows, -1)
    h = _hash(keys, ids, BLOCK_SALT)
    smallest = _exponential(h) / BLOCK  # from the top 24 bits
    winner = h & (BLOCK - 1)  # the low bits
    return smallest, winner


def _token_exponentials(keys, token_ids: torch.Tensor) -> torch.Tensor:
    """(R, N) the own Exp(1) of each token, added to its block's smallest."""
    return _exponential(_hash(keys, token_ids, 0))


def _padded(scores: torch.Tensor) -> torch.Tensor:
    """(R, V) -> (R, NB, BLOCK) float32, -inf past the vocabulary (a view where V is a
    multiple of BLOCK, as most vocabularies are)."""
    num_blocks = math.ceil(scores.shape[1] / BLOCK)
    scores = scores.float()
    if num_blocks * BLOCK != scores.shape[1]:
        scores = F.pad(scores, (0, num_blocks * BLOCK - scores.shape[1]), value=-math.inf)
    return scores.reshape(scores.shape[0], num_blocks, BLOCK)


def perturbed_scores(
    scores: torch.Tensor,  # (R, V) log-probabilities up to a constant per row; -inf: excluded
    seeds: torch.Tensor,  # (R,) int64
    positions: torch.Tensor,  # (R,) int64, the sampled token's position in its sequence
) -> torch.Tensor:
    """(R, V) float32 scores + noise, all the noise made: the draw is their argmax."""
    keys = row_keys(seeds.to(scores.device), positions.to(scores.device))
    padded = _padded(scores)  # (R, NB, S)
    num_rows, num_blocks, _ = padded.shape
    smallest, winner = _blocks(keys, num_blocks, num_rows, scores.device)
    token_ids = torch.arange(num_blocks * BLOCK, dtype=torch.int64, device=scores.device)
    own = _token_exponentials(keys, token_ids.expand(num_rows, -1)).view_as(padded)
    own.scatter_(-1, winner[..., None], 0.0)
    values = padded - torch.log(smallest[..., None] + own)
    return values.view(num_rows, -1)[:, : scores.shape[1]]


def gumbel_argmax_dense(
    scores: torch.Tensor,  # (R, V)
    seeds: torch.Tensor,  # (R,) int64
    positions: torch.Tensor,  # (R,) int64
) -> torch.Tensor:
    """(R,) int64 tokens: the argmax of perturbed_scores (the reference)."""
    return perturbed_scores(scores, seeds, positions).argmax(dim=-1)


def gumbel_argmax(
    scores: torch.Tensor,  # (R, V) log-probabilities up to a constant per row; -inf: excluded
    seeds: torch.Tensor,  # (R,) int64
    positions: torch.Tensor,  # (R,) int64, the sampled token's position in its sequence
) -> torch.Tensor:
    """(R,) int64 tokens: argmax(scores + noise), an exact draw from softmax(scores), making
    the noise only of blocks that can win (the same tokens as gumbel_argmax_dense)."""
    keys = row_keys(seeds.to(scores.device), positions.to(scores.device))
    padded = _padded(scores)  # (R, NB, S)
    num_rows, num_blocks, _ = padded.shape
    smallest, winner = _blocks(keys, num_blocks, num_rows, scores.device)
    largest_noise = -torch.log(smallest)  # (R, NB): the noise of each block's winner
    found = (padded.gather(-1, winner[..., None]).squeeze(-1) + largest_noise).amax(-1)  # (R,)
    block_best = padded.amax(-1)  # (R, NB)
    # A block whose best score plus its largest noise stays below a value already found
    # cannot hold the argmax; a block of excluded tokens never can.
    open_blocks = (block_best + largest_noise >= found[:, None]) & (block_best > -math.inf)
    rows, blocks = torch.nonzero(open_blocks, as_tuple=True)  # (E,) each
    token_ids = blocks[:, None] * BLOCK + torch.arange(BLOCK, device=scores.device)  # (E, S)
    own = _token_exponentials((keys[0][rows], keys[1][rows]), token_ids)
    own.scatter_(-1, winner[rows, blocks][:, None], 0.0)
    values = padded[rows, blocks] - torch.log(smallest[rows, blocks][:, None] + own)  # (E, S)
    best_values, best_in_block = values.max(dim=-1)  # (E,)
    row_best = torch.full((num_rows,), -math.inf, device=scores.device)
    row_best = row_best.scatter_reduce(0, rows, best_values, "amax")
    # Ties between blocks go to the lowest token id, as argmax does.
    candidates = torch.where(
        best_values == row_best[rows],
        blocks * BLOCK + best_in_block,
        torch.full_like(blocks, num_blocks * BLOCK),
    )
    tokens = torch.full((num_rows,), num_blocks * BLOCK, dtype=torch.int64, device=scores.device)
    return tokens.scatter_reduce(0, rows, candidates, "amin")
