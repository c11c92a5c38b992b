"""The loop's settings (the speculative_decoding model's config.pbtxt parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.loop.prefix_cache import DEFAULT_PREFIX_MIN_TOKENS
from specdec.loop.proposers import PROPOSERS
from specdec.loop.proposers.ngram import DEFAULT_MATCH_LENGTHS
from specdec.loop.proposers.suffix import DEFAULT_STORE_BYTES

# Prompt tokens prefilled per step beyond the rows that run whole (docs/benchmarks-archive.md,
# "2026-12-04 (evening): prefix reuse and chunked prefill").
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class SchedulerConfig:
    num_slots: int  # KV cache slots per engine: the most sequences running at once
    max_context: int  # positions per slot
    max_draft_tokens: int  # upper bound on k
    default_draft_tokens: int | None  # k for requests without num_draft_tokens; None: adaptive
    max_queue: int = 1024  # waiting requests beyond this are refused
    proposer_names: tuple[str, ...] = PROPOSERS  # those the server runs, in order of preference
    ngram_match_lengths: tuple[int, ...] = DEFAULT_MATCH_LENGTHS
    # The suffix proposer's store of every request's text, at most this many bytes.
    suffix_store_bytes: int = DEFAULT_STORE_BYTES
    # Prompts that start with at least this many tokens of a cached or running sequence's
    # start from them (specdec/loop/prefix_cache.py); None: no reuse across requests.
    prefix_min_tokens: int | None = DEFAULT_PREFIX_MIN_TOKENS
    # A prompt with more than this many tokens left to prefill joins in chunks of at most
    # this many per step (all chunks of a step together); None: every prompt prefills whole.
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK
