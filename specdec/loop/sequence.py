"""One output sequence as the loop keeps it: its tokens, its cache slot and lengths, its counts.

A request may carry several prompts and ask for several sequences of each
(num_return_sequences): every one is a `SequenceState` of its own, a row of the batch while it
runs. A proposer keeps its own per-row state (specdec/loop/proposers/); what is here is what
every part of the loop reads: the tokens, the caches' valid lengths, the stop conditions'
outcome and what the responses report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specdec.engines.wire import EngineBatch
from specdec.text.detokenizer import IncrementalDetokenizer
from specdec.text.request import GUIDE_FIELD, GenerationRequest


@dataclass
class SequenceStats:
    num_draft_tokens: int = 0  # proposed
    num_accepted_draft_tokens: int = 0
    num_target_passes: int = 0

    @property
    def acceptance_rate(self) -> float:
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_draft_tokens / self.num_draft_tokens


@dataclass
class SequenceTimes:
    """Unix time in ns (TensorRT-LLM's *_time_ns outputs); 0 until it happened."""

    arrival_ns: int = 0  # submitted
    first_scheduled_ns: int = 0  # got its slot
    first_token_ns: int = 0  # its first output token was committed
    last_token_ns: int = 0  # its latest output token was committed
    previous_token_ns: int = 0  # the commit before that one (the inter-token histogram's gap)


@dataclass(eq=False)  # one sequence is equal only to itself
class SequenceState:
    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    seed: int  # its sampling noise (specdec/engines/coupling.py), in [0, 2**63)
    id: int = 0
    slot: int = -1  # its KV cache slot in both engines; -1 while it waits
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    target_cache_length: int = 0  # valid positions in its target slot
    draft_cache_length: int = 0  # valid positions in its draft slot
    stats: SequenceStats = field(default_factory=SequenceStats)
    finish_reason: str | None = None  # "end", "length", "stop", "cancelled", "error"
    error: str = ""  # why, where the loop itself ended it with "error"
    cancelled: bool = False
    sequence_index: int = 0  # which of its prompt's num_return_sequences
    parent: SequenceState | None = None  # its prompt's first sequence: the prompt cache's source
    copy_source_slot: int = -1  # >= 0: copy a prefix's cache from there at the first step
    copy_from: SequenceState | None = None  # the sequence that holds it (parent or running)
    copy_length: int = 0  # positions to copy
    num_copied_positions: int = 0  # cache positions copied instead of computed
    output_log_probs: list[float] = field(default_factory=list)  # one per output token
    times: SequenceTimes = field(default_factory=SequenceTimes)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_ids)

    @property
    def num_cache_positions(self) -> int:
        """Positions of its target slot it holds (copied ones included)."""
        return max(self.target_cache_length, self.num_copied_positions)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- its caches' valid lengths: written here only --------------------------------------
    def start_from(self, target_length: int, draft_length: int | None) -> None:
        """Its slot's caches hold its first positions already: adopted where another
        sequence left them, or copied from another slot by this step's calls (draft_length
        None: the draft's cache is not copied; its draft catches up)."""
        self.target_cache_length = self.num_copied_positions = target_length
        if draft_length is not None:
            self.draft_cache_length = draft_length

    def prefilled(self, num_tokens: int) -> None:
        """A chunk of its prompt was written to the target's cache (it emitted nothing)."""
        self.target_cache_length += num_tokens

    def drafted(self, num_proposed: int) -> None:
        """The draft model was fed its pending tokens and proposed `num_proposed`: it cached
        all it was fed, the pending tokens and every proposal but the last."""
        self.draft_cache_length = len(self.token_ids) + max(num_proposed - 1, 0)

    def committed(self) -> None:
        """After a verdict, the valid cache prefixes are every token but the newest (never
        fed yet): rejected proposals roll back by a shorter length, nothing else."""
        self.target_cache_length = len(self.token_ids) - 1
        self.draft_cache_length = min(self.draft_cache_length, len(self.token_ids) - 1)


@dataclass
class Update:
    """What one step did for one sequence: the glue turns it into a response."""

    sequence: SequenceState
    text: str  # new text ("" when the step added none that is complete)
    finished: bool
    num_emitted: int = 0  # output tokens it added (0 when its end token came first)


def no_token_error(sequence: SequenceState) -> str:
    """Why a row whose controls left no token to choose (wire.NO_TOKEN) ended."""
    return (
        f"{GUIDE_FIELD}: no token is left at output token {sequence.num_output_tokens + 1}: "
        "the grammar allows only tokens that min_tokens or bad_words forbid"
    )


CacheCopy = tuple[int, int, int]  # (source slot, slot, positions): a prompt cache copied


def engine_batch(
    rows: list[SequenceState],
    pending: list[list[int]],  # per row: the tokens to append to its slot
    cache_lengths: list[int],  # per row: valid positions already in its slot
    num_steps: list[int],  # per row: draft tokens to propose, or target positions to return
    copies: list[CacheCopy] | tuple[()] = (),
) -> EngineBatch:
    """One engine call's tensors for these rows (specdec/engines/wire.py)."""
    requests = [s.request for s in rows]
    copy_columns = np.array(copies, dtype=np.int32).reshape(-1, 3).T  # (3, C)
    batch = EngineBatch(
        input_ids=np.array([t for p in pending for t in p], dtype=np.int64),
        input_lengths=np.array([len(p) for p in pending], dtype=np.int32),
        slot_ids=np.array([s.slot for s in rows], dtype=np.int32),
        cache_lengths=np.array(cache_lengths, dtype=np.int32),
        num_steps=np.array(num_steps, dtype=np.int32),
        temperature=np.array([r.temperature for r in requests], dtype=np.float32),
        top_k=np.array([r.top_k for r in requests], dtype=np.int32),
        top_p=np.array([r.top_p for r in requests], dtype=np.float32),
        end_ids=np.array([r.end_id for r in requests], dtype=np.int32),
        min_tokens_left=np.array(
            [max(0, s.request.min_tokens - s.num_output_tokens) for s in rows],
            dtype=np.int32,
        ),
        seeds=np.array([s.seed for s in rows], dtype=np.int64),
        copy_src_slots=copy_columns[0].copy(),
        copy_dst_slots=copy_columns[1].copy(),
        copy_lengths=copy_columns[2].copy(),
    )
    if any(r.has_logit_controls for r in requests):
        add_logit_controls(batch, rows, cache_lengths)
    return batch


def add_logit_controls(
    batch: EngineBatch, rows: list[SequenceState], cache_lengths: list[int]
) -> None:
    """Fills the batch's logit controls (specdec/engines/controls.py): each row's settings,
    its biases (a one-token bad word: -inf), its longer bad words, and the tokens before its
    cache length that they read. Nothing else carries a row's counts between calls."""
    requests = [s.request for s in rows]
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
        setattr(batch, name, np.array([getattr(r, name) for r in requests], dtype=np.float32))
    batch.occurrence_start = np.array([r.occurrence_start for r in requests], dtype=np.int32)
    history: list[np.ndarray] = []  # per row: the tokens its controls read
    biases: list[tuple[int, int, float]] = []  # (row, token, value)
    words: list[tuple[int, list[int]]] = []  # (row, bad word)
    guided: list[int] = []
    for row, (sequence, cached) in enumerate(zip(rows, cache_lengths, strict=True)):
        request = sequence.request
        if request.guide is not None:
            guided.append(row)
        biases += [(row, token, value) for token, value in request.logit_bias.items()]
        for word in request.bad_words_ids:
            if len(word) == 1:
                biases.append((row, word[0], float("-inf")))
            else:
                words.append((row, word))
        first = history_start(request, cached)
        history.append(np.array(sequence.token_ids[first:cached], dtype=np.int32))
    lengths = [len(tokens) for tokens in history]
    batch.history_rows = np.repeat(np.arange(len(rows), dtype=np.int32), lengths)
    batch.history_ids = np.concatenate(history) if history else np.zeros(0, dtype=np.int32)
    batch.bias_rows = np.array([b[0] for b in biases], dtype=np.int32)
    batch.bias_ids = np.array([b[1] for b in biases], dtype=np.int32)
    batch.bias_values = np.array([b[2] for b in biases], dtype=np.float32)
    width = max((len(w) for _, w in words), default=0)
    batch.bad_word_rows = np.array([row for row, _ in words], dtype=np.int32)
    batch.bad_words = np.full((len(words), width), -1, dtype=np.int32)
    for line, (_, word) in enumerate(words):
        batch.bad_words[line, : len(word)] = word
    guides = [rows[row].request.guide for row in guided]
    batch.guide_rows = np.array(guided, dtype=np.int32)
    batch.guide_types = np.array([g.type.encode() for g in guides if g], dtype=np.bytes_)
    batch.guides = np.array([g.text.encode() for g in guides if g], dtype=np.bytes_)
    batch.guide_starts = np.array(
        [len(rows[row].request.prompt_ids) for row in guided], dtype=np.int32
    )


def history_start(request: GenerationRequest, cache_length: int) -> int:
    """The first position of the tokens a call must send for the row's controls: all of them
    for the repetition penalty, those from occurrence_start for presence and frequency, the
    output for a guide, the last (longest bad word - 1) for bad words."""
    first = cache_length
    if request.repetition_penalty != 1.0:
        first = 0
    elif request.presence_penalty != 0.0 or request.frequency_penalty != 0.0:
        first = request.occurrence_start
    if request.guide is not None:
        first = min(first, len(request.prompt_ids))
    longest = max((len(w) for w in request.bad_words_ids), default=0)
    return max(0, min(first, cache_length - longest + 1))
