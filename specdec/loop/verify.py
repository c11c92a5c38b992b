"""Verification of proposals: the longest prefix that equals the target's own tokens.

For every row the target returns its own token after each prefix: the argmax (greedy) or a
draw with Gumbel noise keyed by the row's seed and the position (sampled rows;
specdec/engines/coupling.py). A proposal is accepted up to its first token that differs
from the target's, and the target's token there (a recovered token) or after the last
proposal (the bonus token) is emitted. Every emitted token is the target's own choice at its
position, so the output is what the target alone would produce with the same seed, whoever
proposed:
- greedy: plain greedy decoding (Leviathan et al., arXiv 2211.17192);
- sampled: the target's distribution exactly. A model draft that sampled its proposals with
  the same noise is accepted with probability at least (1 - d)/(1 + d) per token, d the
  total-variation distance between the two distributions, against 1 - d for modified
  rejection sampling (Chen et al., arXiv 2302.01318); a point-mass proposal x (prompt
  lookup) with probability p(x), as there (Daliri, Musco, Suresh, arXiv 2408.07978).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Verdict:
    num_accepted: int  # proposed tokens accepted, 0..k
    token_ids: list[int]  # accepted tokens + one recovered or bonus token (k + 1 at most)


def verify(
    draft_token_ids: list[int],  # (k,) the proposal
    target_token_ids: list[int],  # (k + 1,) the target's own token after each prefix
) -> Verdict:
    """Accepts the longest prefix of the proposal that equals the target's tokens."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and (
        draft_token_ids[num_accepted] == target_token_ids[num_accepted]
    ):
        num_accepted += 1
    emitted = list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]]
    return Verdict(num_accepted, emitted)
