"""The engine interface: one call, many rows, for the draft (propose) and the target (verify).

Both engine models take the same tensors and return the same tensors; only the work differs.
- draft:  append each row's new tokens to its slot, then propose `num_steps` tokens one at a
          time (all k steps inside one call: one Triton call per draft step would eat the gain).
          A greedy row that catches up (fed more than 2 tokens) also gets, for up to
          LOOKBACK_TOKENS of them, the draft's argmax guess of each from the tokens before
          it: how often it would have agreed with what plain decoding produced, without a
          verify.
- target: append each row's new tokens (pending tokens + the draft's proposals) and return,
          for the row's last `num_steps` positions, the target argmax (greedy rows) or the
          target distribution (sampled rows); for greedy rows that ask (return_log_probs),
          also the argmax's log-probability.
Probabilities cross the model boundary only for sampled rows.
Before either runs, the call copies cache prefixes between slots (copy_*): the sequences a
request asks for with num_return_sequences share its prompt's cache, filled once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import (
    RowSampling,
    block_end_tokens,
    greedy_tokens,
    probs_from_logits,
    sample_token,
)


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
    seeds: np.ndarray  # (B,) int64, the draft's sampling seed for this call
    # Optional: an empty default is left out of the Triton call.
    return_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    copy_src_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    copy_dst_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    copy_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))

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
        return cls(**{n: np.asarray(arrays[n]).reshape(-1) for n in names if n in arrays})

    def wants_log_probs(self) -> np.ndarray:
        """(B,) bool: rows whose greedy tokens come with their log-probability."""
        if not self.return_log_probs.size:
            return np.zeros(len(self.slot_ids), dtype=np.bool_)
        return self.return_log_probs.astype(np.bool_)

    def rows_sampling(self, rows: np.ndarray, positions: np.ndarray) -> RowSampling:
        """Sampling parameters for logits rows taken from batch rows `rows` at `positions`."""
        return RowSampling(
            temperature=torch.from_numpy(self.temperature[rows].astype(np.float32)),
            top_k=torch.from_numpy(self.top_k[rows].astype(np.int64)),
            top_p=torch.from_numpy(self.top_p[rows].astype(np.float32)),
            end_id=torch.from_numpy(self.end_ids[rows].astype(np.int64)),
            block_end=torch.from_numpy(positions < self.min_tokens_left[rows]),
        )


# The most fed tokens per row the draft guesses in hindsight: enough samples for the
# acceptance estimate from one catch-up, while the reduced head over them stays cheap.
LOOKBACK_TOKENS = 32


def lookback_lengths(input_lengths: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Guesses per row: only a greedy row's catch-up. A sampled row's tokens are draws, not
    the argmax; and a drafting row is fed 1 or 2 tokens, where 2 means its proposals all
    won and the one guess (of the bonus token) would favour easy text."""
    catching_up = (input_lengths > 2) & (temperature == 0)
    return np.where(catching_up, np.minimum(input_lengths.astype(np.int64) - 1, LOOKBACK_TOKENS), 0)


OPTIONAL_BATCH_FIELDS = ("return_log_probs", "copy_src_slots", "copy_dst_slots", "copy_lengths")


def apply_copies(engine, batch: EngineBatch) -> None:
    """Copies the first copy_lengths positions of each source slot's cache into its
    destination slot, before the call writes anything."""
    for src, dst, length in zip(
        batch.copy_src_slots, batch.copy_dst_slots, batch.copy_lengths, strict=True
    ):
        if length > 0:
            engine.copy_slot(int(src), int(dst), int(length))


@dataclass
class EngineResult:
    token_ids: np.ndarray  # (B, max num_steps) int64, -1 where a row has no token
    probs: np.ndarray  # (P, V) float32, sampled rows' distributions, rows in order
    # (B, L) int64, draft only: row r's first n entries (n: those >= 0) are its argmax
    # guesses of its last n fed tokens, in order, each from the tokens before it
    # (n = lookback_lengths(...)[r]).
    lookback_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    # (B, max num_steps) float32, target only: log-probability of token_ids[r, j] for greedy
    # rows with return_log_probs (0 elsewhere); (0, 0) when no row asked.
    log_probs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> EngineResult:
        return cls(**{f.name: arrays[f.name] for f in fields(cls)})

    def lookback(self, row: int) -> list[int]:
        """Row's guesses of its last fed tokens (see lookback_ids)."""
        if row >= self.lookback_ids.shape[0]:
            return []
        guesses = self.lookback_ids[row]
        return guesses[guesses >= 0].tolist()


def _empty_result(batch: EngineBatch, vocab_size: int) -> EngineResult:
    width = int(batch.num_steps.max()) if batch.num_steps.size else 0
    num_rows = len(batch.slot_ids)
    return EngineResult(
        token_ids=np.full((num_rows, width), -1, dtype=np.int64),
        probs=np.zeros((0, vocab_size), dtype=np.float32),
        lookback_ids=np.zeros((num_rows, 0), dtype=np.int64),
    )


def run_target(engine: LlamaEngine, batch: EngineBatch) -> EngineResult:
    """Appends the rows' tokens and scores their last num_steps positions."""
    apply_copies(engine, batch)
    result = _empty_result(batch, engine.config.vocab_size)
    logits = engine.forward(
        torch.from_numpy(batch.input_ids.astype(np.int64)),
        batch.input_lengths.tolist(),
        batch.slot_ids.tolist(),
        batch.cache_lengths.tolist(),
        batch.num_steps.tolist(),
    )  # (sum num_steps, V)
    rows = np.repeat(np.arange(len(batch.slot_ids)), batch.num_steps)
    positions = np.concatenate([np.arange(n) for n in batch.num_steps])
    sampling = batch.rows_sampling(rows, positions)
    greedy = sampling.temperature == 0
    if bool(greedy.any()):
        picked = torch.nonzero(greedy).flatten()
        tokens = greedy_tokens(logits[picked], sampling.select(picked)).numpy()
        result.token_ids[rows[picked.numpy()], positions[picked.numpy()]] = tokens
        _greedy_log_probs(result, batch, logits, sampling, rows, positions)
    if bool((~greedy).any()):
        picked = torch.nonzero(~greedy).flatten()
        probs = probs_from_logits(logits[picked], sampling.select(picked))
        result.probs = probs.numpy()
    return result


def _greedy_log_probs(result, batch, logits, sampling, rows, positions) -> None:
    """log_probs of the greedy rows that ask: the log-softmax (temperature 1, the end token
    blocked where min_tokens says so) at the argmax each position emits."""
    wanted = batch.wants_log_probs()[rows] & (batch.temperature[rows] == 0)
    if not wanted.any():
        return
    index = np.nonzero(wanted)[0]
    picked = torch.from_numpy(index)
    chosen = block_end_tokens(logits[picked].float(), sampling.select(picked))
    log_probs = torch.log_softmax(chosen, dim=-1)  # (R, V)
    tokens = torch.from_numpy(result.token_ids[rows[index], positions[index]])
    result.log_probs = np.zeros(result.token_ids.shape, dtype=np.float32)
    values = log_probs.gather(-1, tokens[:, None]).squeeze(-1).numpy()
    result.log_probs[rows[index], positions[index]] = values


def run_draft(engine: LlamaEngine, batch: EngineBatch) -> EngineResult:
    """Appends the rows' tokens, guesses the last fed ones in hindsight, then proposes
    num_steps tokens per row (0: none), one step at a time."""
    apply_copies(engine, batch)
    result = _empty_result(batch, engine.config.vocab_size)
    num_rows = len(batch.slot_ids)
    generators = [torch.Generator().manual_seed(int(s)) for s in batch.seeds]
    sampled_probs: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
    cache_lengths = (batch.cache_lengths + batch.input_lengths).astype(np.int64)
    lookback = lookback_lengths(batch.input_lengths, batch.temperature)
    logits = engine.forward(
        torch.from_numpy(batch.input_ids.astype(np.int64)),
        batch.input_lengths.tolist(),
        batch.slot_ids.tolist(),
        batch.cache_lengths.tolist(),
        (lookback + 1).tolist(),
    )  # (sum(lookback + 1), V): the lookback positions, then each row's last position
    ends = np.cumsum(lookback + 1)
    if lookback.max(initial=0) > 0:
        guesses = logits.argmax(dim=-1).numpy()
        result.lookback_ids = np.full((num_rows, int(lookback.max())), -1, dtype=np.int64)
        for r in np.nonzero(lookback)[0]:
            result.lookback_ids[r, : lookback[r]] = guesses[ends[r] - 1 - lookback[r] : ends[r] - 1]
    rows = np.nonzero(batch.num_steps > 0)[0]
    logits = logits[torch.from_numpy(ends[rows] - 1)]  # (rows, V)
    for step in range(int(batch.num_steps.max(initial=0))):
        sampling = batch.rows_sampling(rows, np.full(len(rows), step))
        tokens = greedy_tokens(logits, sampling).numpy()
        for i in np.nonzero(batch.temperature[rows] > 0)[0]:
            probs = probs_from_logits(logits[i : i + 1], sampling.select(torch.tensor([i])))[0]
            tokens[i] = sample_token(probs, generators[rows[i]])
            sampled_probs[rows[i]].append(probs)
        result.token_ids[rows, step] = tokens
        more = batch.num_steps[rows] > step + 1
        rows, tokens = rows[more], tokens[more]
        if not len(rows):
            break
        logits = engine.forward(
            torch.from_numpy(tokens.astype(np.int64)),
            [1] * len(rows),
            batch.slot_ids[rows].tolist(),
            cache_lengths[rows].tolist(),
            [1] * len(rows),
        )
        cache_lengths[rows] += 1
    flat = [p for row in sampled_probs for p in row]
    if flat:
        result.probs = torch.stack(flat).numpy()
    return result


class LocalEngines:
    """Both engines in this process (unit tests, offline checks): no Triton in between."""

    def __init__(self, draft_engine: LlamaEngine, target_engine: LlamaEngine) -> None:
        self.draft_engine = draft_engine
        self.target_engine = target_engine

    def draft(self, batch: EngineBatch) -> EngineResult:
        return run_draft(self.draft_engine, batch)

    def target(self, batch: EngineBatch) -> EngineResult:
        return run_target(self.target_engine, batch)
