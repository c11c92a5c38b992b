"""The engine call's wire format: what the loop sends to an engine model and what it gets back.

Both engine models take the same tensors and return the same tensors; only the work differs.
- draft:  append each row's new tokens to its slot, then propose `num_steps` tokens one at a
          time (all k steps inside one call: one Triton call per draft step would eat the gain).
          A greedy row that catches up (fed more than 2 tokens) also gets, for up to
          HINDSIGHT_TOKENS of them, whether the draft's argmax guess of each from the tokens
          before it was right: how often it would have agreed with what plain decoding
          produced, without a verify.
- target: append each row's new tokens (pending tokens + the proposals) and return the
          target's own token at the row's last `num_steps` positions: the argmax (greedy
          rows) or a draw (sampled rows); for rows that ask (return_log_probs), also its
          log-probability.
Only tokens leave an engine, never logits or distributions: a sampled row's draws use noise
keyed by the row's seed and the token's position (specdec/engines/coupling.py), the same in
both engines, so a proposal is accepted exactly when it equals the target's token.
Before either runs, the call copies cache prefixes between slots (copy_*): the sequences a
request asks for with num_return_sequences share its prompt's cache, filled once.

Plain numpy: the loop imports this module without loading a decoder. A call's work on an
engine is specdec/engines/calls.py. The engines live in the loop's own process
(specdec/serving/bls_model.py); a call sent from outside it (the draft_model and
target_model models, specdec/serving/engine_model.py) crosses Triton as one encoded tensor
(encode_call / encode_result).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np

# A token an engine returns where a row's controls left nothing to choose (a grammar that
# allows only what min_tokens or bad words forbid, specdec/engines/controls.py).
NO_TOKEN = -2


@dataclass
class EngineBatch:
    input_ids: np.ndarray  # (N,) int64, every row's new tokens, packed
    input_lengths: np.ndarray  # (B,) int32
    slot_ids: np.ndarray  # (B,) int32
    cache_lengths: np.ndarray  # (B,) int32, valid positions already in the slot
    num_steps: np.ndarray  # (B,) int32, draft: tokens to propose; target: positions to return
    temperature: np.ndarray  # (B,) float32
    top_k: np.ndarray  # (B,) int32
    top_p: np.ndarray  # (B,) float32
    end_ids: np.ndarray  # (B,) int32, -1 = none
    min_tokens_left: np.ndarray  # (B,) int32, the end token is blocked at positions below this
    seeds: np.ndarray  # (B,) int64, each row's sequence's seed: its sampling noise
    # Optional: an empty default is left out of the Triton call.
    return_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    copy_src_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    copy_dst_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    copy_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # Logit controls (specdec/engines/controls.py); all empty when no row of the call has any.
    # Per row (B,): the penalties (repetition 1, presence and frequency 0 = off), the first
    # sequence position presence and frequency count, and min_p (0 = off).
    repetition_penalty: np.ndarray = field(default_factory=lambda: _floats(0))
    presence_penalty: np.ndarray = field(default_factory=lambda: _floats(0))
    frequency_penalty: np.ndarray = field(default_factory=lambda: _floats(0))
    occurrence_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    min_p: np.ndarray = field(default_factory=lambda: _floats(0))
    # Row by row (COO: *_rows names the batch row of each entry), in sequence order: the
    # last tokens before the row's cache length that its penalties and bad words read.
    history_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    history_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    # Added to the logits (a banned token: -inf).
    bias_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    bias_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    bias_values: np.ndarray = field(default_factory=lambda: _floats(0))
    # Bad words of two tokens or more, one per line, padded with -1: the last token is
    # banned where the tokens before it end the text.
    bad_word_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    bad_words: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    # Guided rows (specdec/engines/grammar.py), one entry each: the guide's type and text
    # (UTF-8 bytes) and the sequence position where the row's output, the text the grammar
    # reads, starts (history_* holds its tokens from there to the cache length).
    guide_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    guide_types: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S1"))
    guides: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="S1"))
    guide_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in OPTIONAL_BATCH_FIELDS or getattr(self, f.name).size
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> EngineBatch:
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in arrays and n not in OPTIONAL_BATCH_FIELDS]
        if missing:
            raise ValueError(f"engine call misses tensors {missing}")
        return cls(**{n: _field_array(n, arrays[n]) for n in names if n in arrays})

    def has_controls(self) -> np.ndarray:
        """(B,) bool: rows with a logit control (penalty, min_p, bias, bad word, guide)."""
        rows = np.zeros(len(self.slot_ids), dtype=np.bool_)
        if not self.repetition_penalty.size:
            return rows
        rows |= self.repetition_penalty != 1
        rows |= (self.presence_penalty != 0) | (self.frequency_penalty != 0)
        rows |= self.min_p > 0
        rows[self.bias_rows] = True
        rows[self.bad_word_rows] = True
        rows[self.guide_rows] = True
        return rows

    def wants_log_probs(self) -> np.ndarray:
        """(B,) bool: rows whose tokens come with their log-probability."""
        if not self.return_log_probs.size:
            return np.zeros(len(self.slot_ids), dtype=np.bool_)
        return self.return_log_probs.astype(np.bool_)


# The most fed tokens per row the draft guesses in hindsight: enough samples for the
# acceptance estimate from one catch-up, while the reduced head over them stays cheap (and
# their hits fit one int64).
HINDSIGHT_TOKENS = 32


def hindsight_lengths(input_lengths: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Guesses per row: only a greedy row's catch-up. A sampled row's tokens are draws, not
    the argmax; and a drafting row is fed 1 or 2 tokens, where 2 means its proposals all
    won and the one guess (of the bonus token) would favour easy text."""
    catching_up = (input_lengths > 2) & (temperature == 0)
    return np.where(
        catching_up, np.minimum(input_lengths.astype(np.int64) - 1, HINDSIGHT_TOKENS), 0
    )


def _floats(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


# Logit controls' fields: per row (B,), and entries naming their row (entry field -> its rows).
CONTROL_ROW_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "occurrence_start",
    "min_p",
)
CONTROL_ENTRY_FIELDS = {
    "history_ids": "history_rows",
    "bias_ids": "bias_rows",
    "bias_values": "bias_rows",
    "bad_words": "bad_word_rows",
    "guide_types": "guide_rows",
    "guides": "guide_rows",
    "guide_starts": "guide_rows",
}
CONTROL_FIELDS = CONTROL_ROW_FIELDS + tuple(
    dict.fromkeys([*CONTROL_ENTRY_FIELDS.values(), *CONTROL_ENTRY_FIELDS])
)
MATRIX_FIELDS = ("bad_words",)  # two-dimensional; every other field is (n,)


def _field_array(name: str, value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    if name not in MATRIX_FIELDS:
        return array.reshape(-1)
    return array if array.ndim == 2 else array.reshape(0, 0)


OPTIONAL_BATCH_FIELDS = (
    "return_log_probs",
    "copy_src_slots",
    "copy_dst_slots",
    "copy_lengths",
    *CONTROL_FIELDS,
)


@dataclass
class EngineResult:
    token_ids: np.ndarray  # (B, max num_steps) int32, -1 where a row has no token
    # (B,) int64, draft only: bit j of row r says whether the draft's argmax guess of the
    # j-th of its last n fed tokens (oldest first), from the tokens before it, was right
    # (n = hindsight_lengths(...)[r]); (0,) when no row guessed.
    hindsight_hits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # (B, max num_steps) float32, target only: log-probability of token_ids[r, j] for rows
    # with return_log_probs (0 elsewhere); (0, 0) when no row asked.
    log_probs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def nbytes(self) -> int:
        """Bytes the call returned: what crosses from the engine model to the loop."""
        return sum(array.nbytes for array in self.to_arrays().values())

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> EngineResult:
        return cls(**{f.name: arrays[f.name] for f in fields(cls) if f.name in arrays})

    def hindsight(self, row: int, num_guesses: int) -> list[bool]:
        """Whether each of the row's guesses of its last num_guesses fed tokens was right,
        oldest first (see hindsight_hits)."""
        if not num_guesses or row >= self.hindsight_hits.shape[0]:
            return []
        bits = int(self.hindsight_hits[row])
        return [bool(bits >> j & 1) for j in range(num_guesses)]


class Engines(Protocol):
    """The loop's two engine calls: the engine models over Triton
    (specdec/serving/bls_model.py) or both engines in this process
    (LocalEngines in specdec/engines/calls.py)."""

    def draft(self, batch: EngineBatch) -> EngineResult: ...
    def target(self, batch: EngineBatch) -> EngineResult: ...


ROLES = ("draft", "target")


def _encode(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # plain arrays: np.load below refuses pickled objects
    return buffer.getvalue()


def _decode(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def encode_call(role: str, batch: EngineBatch) -> bytes:
    """One engine call as bytes: its role ("draft" or "target") and its batch's tensors."""
    if role not in ROLES:
        raise ValueError(f"engine role {role!r}: expected one of {', '.join(ROLES)}")
    return _encode({"role": np.array(role), **batch.to_arrays()})


def decode_call(data: bytes) -> tuple[str, EngineBatch]:
    """encode_call's (role, batch); a malformed call raises ValueError naming what is wrong."""
    try:
        arrays = _decode(data)
    except Exception as error:  # not an npz archive, or one holding objects
        raise ValueError(f"engine_call: not an encoded engine call ({error})") from error
    role = str(arrays.pop("role", ""))
    if role not in ROLES:
        raise ValueError(f"engine_call: role {role!r}, expected one of {', '.join(ROLES)}")
    return role, EngineBatch.from_arrays(arrays)


def encode_result(result: EngineResult) -> bytes:
    return _encode(result.to_arrays())


def decode_result(data: bytes) -> EngineResult:
    return EngineResult.from_arrays(_decode(data))
