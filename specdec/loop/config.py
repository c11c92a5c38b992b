"""The loop's settings (the speculative_decoding model's config.pbtxt parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.loop.proposers import PROPOSERS
from specdec.loop.proposers.ngram import DEFAULT_MATCH_LENGTHS


@dataclass
class SchedulerConfig:
    num_slots: int  # KV cache slots per engine: the most sequences running at once
    max_context: int  # positions per slot
    max_draft_tokens: int  # upper bound on k
    default_draft_tokens: int | None  # k for requests without num_draft_tokens; None: adaptive
    max_queue: int = 1024  # waiting requests beyond this are refused
    proposers: tuple[str, ...] = PROPOSERS  # those the server runs, in order of preference
    ngram_match_lengths: tuple[int, ...] = DEFAULT_MATCH_LENGTHS
