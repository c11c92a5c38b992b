"""An engine call's work: the wire format in (specdec/engines/wire.py), tokens out, on any
Engine (torch, onnxruntime or TensorRT; specdec/engines/engine.py). `LocalEngines` holds the
draft and the target engine in the caller's process: the loop's BLS model
(specdec/serving/bls_model.py), unit tests and offline tools.

Where an engine offers padded programs (the torch engine with cuda_graphs: `call_graphs`,
specdec/engines/graphs.py), a call's rows that fit one run there, the whole draft call
(first forward, hindsight guesses, k steps) or the whole verify replayed as one CUDA graph,
with one upload and one download. Rows are independent (each attends only its own slot),
so the rest (prefill rows of more than MAX_BATCHED_QUERY tokens, rows asking for
log-probabilities) run eagerly beside them, and the results are merged in row order. Every
other engine runs each call eagerly: the draft one step at a time."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

import numpy as np
import torch

from specdec.engines.controls import CallControls, LogitControls, apply_controls
from specdec.engines.engine import MAX_BATCHED_QUERY, Engine
from specdec.engines.grammar import Grammars, PositionedMatchers, is_allowed
from specdec.engines.graphs import CallGraphs, fits
from specdec.engines.sampling import RowSampling, choose_tokens
from specdec.engines.wire import (
    CONTROL_ENTRY_FIELDS,
    CONTROL_ROW_FIELDS,
    NO_TOKEN,
    OPTIONAL_BATCH_FIELDS,
    EngineBatch,
    EngineResult,
    hindsight_lengths,
)

EagerCall = Callable[[Engine, EngineBatch, PositionedMatchers | None], EngineResult]
T = TypeVar("T")


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
        min_p=torch.from_numpy(batch.min_p[rows].astype(np.float32)) if batch.min_p.size else None,
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
    controls: LogitControls | None = None,  # the rows' logit controls (CallControls)
    with_log_probs: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens (R,) int32 and, where rows ask, their log-probabilities (R,) float32: chosen
    where the logits are; only these numbers come back to the host."""
    wanted = torch.from_numpy(batch.wants_log_probs()[rows]) if with_log_probs else None
    tokens, log_probs = choose_tokens(
        apply_controls(logits, controls),
        rows_sampling(batch, rows, steps, logits.device),
        torch.from_numpy(batch.seeds[rows].astype(np.int64)),
        torch.from_numpy(positions.astype(np.int64)),
        None if wanted is None else wanted.to(logits.device),
    )
    chosen = tokens.cpu().numpy().astype(np.int32)
    if controls is not None and controls.bitmask is not None and controls.guided_rows is not None:
        guided = controls.guided_rows.cpu().numpy()
        left = ~is_allowed(controls.bitmask, guided, chosen[guided])
        chosen[guided[left]] = NO_TOKEN  # nothing the grammar allows was left to choose
    values = None if log_probs is None else log_probs.cpu().numpy()
    return chosen, values


def run_target(
    engine: Engine, batch: EngineBatch, matchers: PositionedMatchers | None = None
) -> EngineResult:
    """Appends the rows' tokens and chooses the target's token at their last num_steps
    positions. `matchers`: guided rows' grammars (specdec/engines/grammar.py)."""
    apply_copies(engine, batch)
    return _split(engine, batch, "target", _eager_target, matchers)


def run_draft(
    engine: Engine, batch: EngineBatch, matchers: PositionedMatchers | None = None
) -> EngineResult:
    """Appends the rows' tokens, guesses the last fed ones in hindsight, then proposes
    num_steps tokens per row (0: none), one step at a time; a row stops proposing at a
    position where its controls leave no token (NO_TOKEN)."""
    apply_copies(engine, batch)
    return _split(engine, batch, "draft", _eager_draft, matchers)


def offered_graphs(engine: Engine) -> CallGraphs | None:
    """The engine's padded programs, where it has them (the torch engine with
    cuda_graphs); every other engine runs its calls eagerly."""
    return getattr(engine, "call_graphs", None)


# A draft call's rows feed 1 or 2 tokens (the pending one, and the bonus); a row catching up
# feeds up to MAX_BATCHED_QUERY. A padded program is as wide as its widest row, so catching-up
# rows get a program of their own rather than widening every row's.
DRAFT_NARROW_WIDTH = 2


def _split(
    engine: Engine,
    batch: EngineBatch,
    role: str,
    eager: EagerCall,
    matchers: PositionedMatchers | None,
) -> EngineResult:
    """Rows are independent (each attends only its own slot), so the rows a padded program
    takes run there (a draft call's catching-up rows in a program of their own) and the
    others (prefill, log-probabilities) eagerly; the results are merged in row order."""
    graphs = offered_graphs(engine)
    if graphs is None:
        return eager(engine, batch, matchers)
    taken = fits(batch, role)
    narrow = batch.input_lengths <= (DRAFT_NARROW_WIDTH if role == "draft" else MAX_BATCHED_QUERY)
    padded: Callable[[EngineBatch], EngineResult] = functools.partial(
        _graph_target if role == "target" else _graph_draft, graphs
    )

    def eagerly(part: EngineBatch) -> EngineResult:
        return eager(engine, part, matchers)

    groups = [(taken & narrow, padded), (taken & ~narrow, padded), (~taken, eagerly)]
    present = [(group, run) for group, run in groups if group.any()]
    if len(present) <= 1:  # the whole call in one piece (an empty one padded)
        return (present[0][1] if present else padded)(batch)
    rows = [np.nonzero(group)[0] for group, _ in present]
    parts = [run(select_rows(batch, r)) for r, (_, run) in zip(rows, present, strict=True)]
    return merge_results(batch, rows, parts)


def select_rows(batch: EngineBatch, rows: np.ndarray) -> EngineBatch:
    """The batch's rows `rows` (in that order) as a batch of their own, without the slot
    copies (the call made them first)."""
    starts = np.cumsum(batch.input_lengths) - batch.input_lengths
    tokens = [batch.input_ids[starts[r] : starts[r] + batch.input_lengths[r]] for r in rows]
    per_row = {
        f.name: getattr(batch, f.name)[rows]
        for f in fields(EngineBatch)
        if f.name != "input_ids" and f.name not in OPTIONAL_BATCH_FIELDS
    }
    selected = EngineBatch(input_ids=np.concatenate(tokens), **per_row)
    for name in ("return_log_probs", *CONTROL_ROW_FIELDS):
        if getattr(batch, name).size:
            setattr(selected, name, getattr(batch, name)[rows])
    new_row = np.full(len(batch.slot_ids), -1, dtype=np.int32)
    new_row[rows] = np.arange(len(rows))
    for rows_name in dict.fromkeys(CONTROL_ENTRY_FIELDS.values()):
        kept = np.nonzero(new_row[getattr(batch, rows_name)] >= 0)[0]
        setattr(selected, rows_name, new_row[getattr(batch, rows_name)[kept]])
        for name, its_rows in CONTROL_ENTRY_FIELDS.items():
            if its_rows == rows_name:
                setattr(selected, name, getattr(batch, name)[kept])
    return selected


def merge_results(
    batch: EngineBatch, rows: list[np.ndarray], parts: list[EngineResult]
) -> EngineResult:
    """One call's result from the results of its parts (part i: the batch's rows rows[i])."""
    result = _empty_result(batch)
    num_rows, width = result.token_ids.shape
    if any(part.hindsight_hits.size for part in parts):
        result.hindsight_hits = np.zeros(num_rows, dtype=np.int64)
    if any(part.log_probs.size for part in parts):
        result.log_probs = np.zeros((num_rows, width), dtype=np.float32)
    for part_rows, part in zip(rows, parts, strict=True):
        result.token_ids[part_rows, : part.token_ids.shape[1]] = part.token_ids
        if part.hindsight_hits.size:
            result.hindsight_hits[part_rows] = part.hindsight_hits
        if part.log_probs.size:
            result.log_probs[part_rows, : part.log_probs.shape[1]] = part.log_probs
    return result


def _graph_target(graphs: CallGraphs, batch: EngineBatch) -> EngineResult:
    """run_target's tokens from the target's padded program."""
    width = int(batch.num_steps.max())
    tokens = graphs.run("target", batch)[:, :width]
    own = np.arange(width) < batch.num_steps[:, None]
    return EngineResult(token_ids=np.where(own, tokens, -1).astype(np.int32))


def _graph_draft(graphs: CallGraphs, batch: EngineBatch) -> EngineResult:
    """run_draft's tokens and hindsight hits from the draft's padded program."""
    result = _empty_result(batch)
    width = result.token_ids.shape[1]
    output = graphs.run("draft", batch)  # (B, k [+ fed tokens])
    own = np.arange(width) < batch.num_steps[:, None]
    result.token_ids[:] = np.where(own, output[:, :width], -1)
    hindsight = hindsight_lengths(batch.input_lengths, batch.temperature)
    if hindsight.max(initial=0) > 0:
        guesses = output[:, max(width, 1) :]  # (B, widest row): after each fed token
        result.hindsight_hits = _hindsight_hits(
            batch, hindsight, lambda r: guesses[r, : batch.input_lengths[r]]
        )
    return result


def _eager_target(
    engine: Engine, batch: EngineBatch, matchers: PositionedMatchers | None = None
) -> EngineResult:
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
    positions = fed[rows] + steps + 1
    call = CallControls(batch, matchers, "target")
    controls = call.for_logits(rows, positions, lambda row: call.inputs[row], logits)
    tokens, log_probs = _choose(logits, batch, rows, steps, positions, controls, True)
    result.token_ids[rows, steps] = tokens
    if log_probs is not None:
        result.log_probs = np.zeros(result.token_ids.shape, dtype=np.float32)
        result.log_probs[rows, steps] = log_probs
    return result


def _eager_draft(
    engine: Engine, batch: EngineBatch, matchers: PositionedMatchers | None = None
) -> EngineResult:
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
        guesses = logits.argmax(dim=-1).cpu().numpy()
        result.hindsight_hits = _hindsight_hits(batch, hindsight, lambda r: guesses[: ends[r]])
    rows = np.nonzero(batch.num_steps > 0)[0]
    logits = logits[torch.from_numpy(ends[rows] - 1).to(logits.device)]  # (rows, V)
    call = CallControls(batch, matchers, "draft")

    def written(row: int) -> np.ndarray:  # its input, then its proposals so far
        proposals = result.token_ids[row]
        return np.concatenate([call.inputs[row], proposals[proposals >= 0]])

    for step in range(int(batch.num_steps.max(initial=0))):
        steps = np.full(len(rows), step)
        controls = call.for_logits(rows, cache_lengths[rows], written, logits)
        tokens, _ = _choose(logits, batch, rows, steps, cache_lengths[rows], controls)
        result.token_ids[rows, step] = np.where(tokens == NO_TOKEN, -1, tokens)
        more = (batch.num_steps[rows] > step + 1) & (tokens != NO_TOKEN)
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
    batch: EngineBatch, hindsight: np.ndarray, guesses: Callable[[int], np.ndarray]
) -> np.ndarray:
    """(B,) int64 bit masks: the draft's argmax after each of a catching-up row's fed tokens
    against the fed token that followed it (see EngineResult.hindsight_hits). guesses(r):
    row r's argmax after each of its fed tokens, up to its last."""
    starts = np.cumsum(batch.input_lengths) - batch.input_lengths
    hits = np.zeros(len(batch.slot_ids), dtype=np.int64)
    for r in np.nonzero(hindsight)[0]:
        n = int(hindsight[r])
        guessed = guesses(r)[-1 - n : -1]
        end = starts[r] + batch.input_lengths[r]
        fed = batch.input_ids[end - n : end]
        hits[r] = int(sum(1 << j for j in np.nonzero(guessed == fed)[0]))
    return hits


def on_a_passing_thread(work: Callable[[], T]) -> T:
    """work() on a thread of its own, which ends with it; its exception is raised here.

    torch's CPU kernels run on an OpenMP team that belongs to the thread that starts them,
    and a process that holds a second team (its main thread's, after loading the engines
    there) ran the loop thread's engine calls 15-20% slower on 2 cores (the real target,
    16 rows, bfloat16; docs/benchmarks.md, "Engines in the BLS's process"). A passing
    thread's team ends with it, so the loop thread's is the only one left."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 -- raised again below, on the caller
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="specdec-engine-work")
    thread.start()
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return value


class LocalEngines:
    """The draft and the target engine in this process, called as the loop calls them
    (the Engines protocol of specdec/engines/wire.py). One call at a time: the loop and a
    call from outside it (specdec/serving/engine_model.py) share the engines' caches."""

    def __init__(
        self, draft_engine: Engine, target_engine: Engine, grammars: Grammars | None = None
    ) -> None:
        self.draft_engine = draft_engine
        self.target_engine = target_engine
        self.grammars = grammars  # guided rows' (None: a guided call is refused)
        self.matchers = PositionedMatchers(grammars) if grammars is not None else None
        self.lock = threading.Lock()

    def draft(self, batch: EngineBatch) -> EngineResult:
        with self.lock:
            return run_draft(self.draft_engine, batch, self.matchers)

    def target(self, batch: EngineBatch) -> EngineResult:
        with self.lock:
            return run_target(self.target_engine, batch, self.matchers)

    def call(self, role: str, batch: EngineBatch) -> EngineResult:
        """The call of `role` ("draft" or "target"; wire.ROLES)."""
        return self.draft(batch) if role == "draft" else self.target(batch)
