"""Engine calls run in this process: the work behind the wire format (specdec/engines/wire.py)
for one LlamaEngine (torch, onnxruntime or TensorRT). The engine models run these behind
Triton (specdec/serving/engine_model.py); `LocalEngines` gives the loop both engines with no
Triton in between (unit tests, offline tools)."""

from __future__ import annotations

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
from specdec.engines.wire import EngineBatch, EngineResult, hindsight_lengths


def rows_sampling(batch: EngineBatch, rows: np.ndarray, positions: np.ndarray) -> RowSampling:
    """Sampling parameters for logits rows taken from batch rows `rows` at `positions`."""
    return RowSampling(
        temperature=torch.from_numpy(batch.temperature[rows].astype(np.float32)),
        top_k=torch.from_numpy(batch.top_k[rows].astype(np.int64)),
        top_p=torch.from_numpy(batch.top_p[rows].astype(np.float32)),
        end_id=torch.from_numpy(batch.end_ids[rows].astype(np.int64)),
        block_end=torch.from_numpy(positions < batch.min_tokens_left[rows]),
    )


def apply_copies(engine, batch: EngineBatch) -> None:
    """Copies the first copy_lengths positions of each source slot's cache into its
    destination slot, before the call writes anything."""
    for src, dst, length in zip(
        batch.copy_src_slots, batch.copy_dst_slots, batch.copy_lengths, strict=True
    ):
        if length > 0:
            engine.copy_slot(int(src), int(dst), int(length))


def _empty_result(batch: EngineBatch, vocab_size: int) -> EngineResult:
    width = int(batch.num_steps.max()) if batch.num_steps.size else 0
    num_rows = len(batch.slot_ids)
    return EngineResult(
        token_ids=np.full((num_rows, width), -1, dtype=np.int64),
        probs=np.zeros((0, vocab_size), dtype=np.float32),
        hindsight_ids=np.zeros((num_rows, 0), dtype=np.int64),
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
    sampling = rows_sampling(batch, rows, positions)
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
        guesses = logits.argmax(dim=-1).numpy()
        result.hindsight_ids = np.full((num_rows, int(hindsight.max())), -1, dtype=np.int64)
        for r in np.nonzero(hindsight)[0]:
            result.hindsight_ids[r, : hindsight[r]] = guesses[
                ends[r] - 1 - hindsight[r] : ends[r] - 1
            ]
    rows = np.nonzero(batch.num_steps > 0)[0]
    logits = logits[torch.from_numpy(ends[rows] - 1)]  # (rows, V)
    for step in range(int(batch.num_steps.max(initial=0))):
        sampling = rows_sampling(batch, rows, np.full(len(rows), step))
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
