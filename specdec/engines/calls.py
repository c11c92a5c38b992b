"""An engine call's work: the wire format in (specdec/engines/wire.py), tokens out, on any
Engine (torch, onnxruntime or TensorRT; specdec/engines/engine.py). `LocalEngines` holds the
draft and the target engine in the caller's process: the loop's BLS model
(specdec/serving/bls_model.py), unit tests and offline tools."""

from __future__ import annotations

import threading

import numpy as np
import torch

from specdec.engines.engine import Engine
from specdec.engines.sampling import RowSampling, choose_tokens
from specdec.engines.wire import EngineBatch, EngineResult, hindsight_lengths


def rows_sampling(
    batch: EngineBatch, rows: np.ndarray, steps: np.ndarray, device: torch.device | str = "cpu"
) -> RowSampling:
    """Sampling parameters for logits rows taken from batch rows `rows` at their `steps`-th
    position of this call (the end token is blocked below min_tokens_left)."""
    sampling = RowSampling(
        temperature=torch.from_numpy(batch.temperature[rows].astype(np.float32)),
        top_k=torch.from_numpy(batch.top_k[rows].astype(np.int64)),
        top_p=torch.from_numpy(batch.top_p[rows].astype(np.float32)),
        end_id=torch.from_numpy(batch.end_ids[rows].astype(np.int64)),
        block_end=torch.from_numpy(steps < batch.min_tokens_left[rows]),
    )
    return sampling.to(device)


def apply_copies(engine: Engine, batch: EngineBatch) -> None:
    """Copies the first copy_lengths positions of each source slot's cache into its
    destination slot, before the call writes anything."""
    for src, dst, length in zip(
        batch.copy_src_slots, batch.copy_dst_slots, batch.copy_lengths, strict=True
    ):
        if length > 0:
            engine.copy_slot(int(src), int(dst), int(length))


def _empty_result(batch: EngineBatch) -> EngineResult:
    width = int(batch.num_steps.max()) if batch.num_steps.size else 0
    return EngineResult(token_ids=np.full((len(batch.slot_ids), width), -1, dtype=np.int32))


def _choose(
    logits: torch.Tensor,  # (R, V) on the engine's device
    batch: EngineBatch,
    rows: np.ndarray,  # (R,) the batch row of each logits row
    steps: np.ndarray,  # (R,) its step in this call
    positions: np.ndarray,  # (R,) the chosen token's position in its sequence
    with_log_probs: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens (R,) int32 and, where rows ask, their log-probabilities (R,) float32: chosen
    where the logits are; only these numbers come back to the host."""
    wanted = torch.from_numpy(batch.wants_log_probs()[rows]) if with_log_probs else None
    tokens, log_probs = choose_tokens(
        logits,
        rows_sampling(batch, rows, steps, logits.device),
        torch.from_numpy(batch.seeds[rows].astype(np.int64)),
        torch.from_numpy(positions.astype(np.int64)),
        None if wanted is None else wanted.to(logits.device),
    )
    values = None if log_probs is None else log_probs.cpu().numpy()
    return tokens.cpu().numpy().astype(np.int32), values


def run_target(engine: Engine, batch: EngineBatch) -> EngineResult:
    """Appends the rows' tokens and chooses the target's token at their last num_steps
    positions."""
    apply_copies(engine, batch)
    result = _empty_result(batch)
    logits = engine.forward(
        torch.from_numpy(batch.input_ids.astype(np.int64)),
        batch.input_lengths.tolist(),
        batch.slot_ids.tolist(),
        batch.cache_lengths.tolist(),
        batch.num_steps.tolist(),
    )  # (sum num_steps, V)
    rows = np.repeat(np.arange(len(batch.slot_ids)), batch.num_steps)
    counts = batch.num_steps.astype(np.int64)
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    # Logits after the fed token at position p choose the token at p + 1.
    fed = batch.cache_lengths.astype(np.int64) + batch.input_lengths - batch.num_steps
    tokens, log_probs = _choose(logits, batch, rows, steps, fed[rows] + steps + 1, True)
    result.token_ids[rows, steps] = tokens
    if log_probs is not None:
        result.log_probs = np.zeros(result.token_ids.shape, dtype=np.float32)
        result.log_probs[rows, steps] = log_probs
    return result


def run_draft(engine: Engine, batch: EngineBatch) -> EngineResult:
    """Appends the rows' tokens, guesses the last fed ones in hindsight, then proposes
    num_steps tokens per row (0: none), one step at a time."""
    apply_copies(engine, batch)
    result = _empty_result(batch)
    cache_lengths = (batch.cache_lengths + batch.input_lengths).astype(np.int64)
    hindsight = hindsight_lengths(batch.input_lengths, batch.temperature)
    logits = engine.forward(
        torch.from_numpy(batch.input_ids.astype(np.int64)),
        batch.input_lengths.tolist(),
        batch.slot_ids.tolist(),
        batch.cache_lengths.tolist(),
        (hindsight + 1).tolist(),
    )  # (sum(hindsight + 1), V): the hindsight positions, then each row's last position
    ends = np.cumsum(hindsight + 1)
    if hindsight.max(initial=0) > 0:
        result.hindsight_hits = _hindsight_hits(batch, logits, hindsight, ends)
    rows = np.nonzero(batch.num_steps > 0)[0]
    logits = logits[torch.from_numpy(ends[rows] - 1).to(logits.device)]  # (rows, V)
    for step in range(int(batch.num_steps.max(initial=0))):
        steps = np.full(len(rows), step)
        tokens, _ = _choose(logits, batch, rows, steps, cache_lengths[rows])
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
    return result


def _hindsight_hits(
    batch: EngineBatch, logits: torch.Tensor, hindsight: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """(B,) int64 bit masks: the draft's argmax after each of a catching-up row's fed tokens
    against the fed token that followed it (see EngineResult.hindsight_hits)."""
    guesses = logits.argmax(dim=-1).cpu().numpy()
    starts = np.cumsum(batch.input_lengths) - batch.input_lengths
    hits = np.zeros(len(batch.slot_ids), dtype=np.int64)
    for r in np.nonzero(hindsight)[0]:
        n = int(hindsight[r])
        guessed = guesses[ends[r] - 1 - n : ends[r] - 1]
        fed = batch.input_ids[
            starts[r] + batch.input_lengths[r] - n : starts[r] + batch.input_lengths[r]
        ]
        hits[r] = int(sum(1 << j for j in np.nonzero(guessed == fed)[0]))
    return hits


class LocalEngines:
    """The draft and the target engine in this process, called as the loop calls them
    (the Engines protocol of specdec/engines/wire.py). One call at a time: the loop and a
    call from outside it (specdec/serving/engine_model.py) share the engines' caches."""

    def __init__(self, draft_engine: Engine, target_engine: Engine) -> None:
        self.draft_engine = draft_engine
        self.target_engine = target_engine
        self.lock = threading.Lock()

    def draft(self, batch: EngineBatch) -> EngineResult:
        with self.lock:
            return run_draft(self.draft_engine, batch)

    def target(self, batch: EngineBatch) -> EngineResult:
        with self.lock:
            return run_target(self.target_engine, batch)

    def call(self, role: str, batch: EngineBatch) -> EngineResult:
        """The call of `role` ("draft" or "target"; wire.ROLES)."""
        return self.draft(batch) if role == "draft" else self.target(batch)
