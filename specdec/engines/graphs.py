"""The torch engine's calls as padded programs, replayed from CUDA graphs on CUDA.

On a GPU, eager decoding is launch-bound: every kernel of every layer is launched from
Python, which costs more than a small model's arithmetic. So each engine call
(specdec/engines/calls.py) of the torch engine (llama.py) runs as one program of fixed
shapes that a CUDA graph captures and replays:
- the target's verify: each row's new tokens appended, the target's token chosen at its
  last num_steps positions;
- the draft's whole call: its first forward (each row's fed tokens), the hindsight argmax
  guesses of a catching-up row, then its k steps, each choosing a token and feeding it back
  on the device.
Tokens are chosen inside the program (sampling.choose_tokens_dense: the same tokens as
choose_tokens, with work that does not depend on the values); logits never leave it.

Padding (what a graph needs to fix its shapes): rows to rows_bucket(rows) (padding rows take
slots no row of the call holds), tokens to the call's widest row (exact widths: at most
MAX_BATCHED_QUERY of them, and a row padded to a wider bucket would make every row of the
call attend and run the head for positions it does not need), key positions to
keys_bucket(longest) (masked past each token's own). Every padding token, and a draft step
of a row that has no more steps, writes a spare position past max_length (the slot cache
reserves SPARE_POSITIONS of them), never a real one; nothing reads them. Masks are made on
the device from the program's inputs, so a replay needs nothing but them.

One call, one upload, one download: the host packs the call's inputs into one int64 staging
buffer (pinned on CUDA) and copies it to the program's device buffer (to_device); the
program's output, tokens and hindsight guesses in one int64 tensor, comes back in one copy
(to_host). Nothing in between reads the device. TRANSFERS counts both.

The graph key (CallKey): role, rows, width, keys, k, the sampling filters (decided on the
host from the batch's arrays) and whether a row guesses in hindsight. Graphs are captured
on first use, not at start: the keys a server meets depend on its traffic (a product of
seven row buckets, up to sixteen widths, the key buckets, k and the filters), and capturing
them all would take minutes and memory for shapes that never come. All graphs share one
memory pool; pool_bytes() says what their captures reserved, and graph_pool_bytes_estimate
what the largest padded call should need.

capture=False runs the same programs without graphs (tests/test_call_graphs.py checks them
on the CPU against eager mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.engines.engine import MAX_BATCHED_QUERY
from specdec.engines.sampling import Filters, RowSampling, choose_tokens_dense
from specdec.engines.wire import EngineBatch, hindsight_lengths

if TYPE_CHECKING:
    from specdec.engines.llama import LlamaConfig, LlamaEngine

SPARE_POSITIONS = MAX_BATCHED_QUERY  # per slot past max_length: padding tokens write there
MIN_KEYS_BUCKET = 128  # the fewest key positions a padded call attends over
ROW_FIELDS = (  # EngineBatch's per-row arrays a program reads, in staging order
    "cache_lengths",
    "input_lengths",
    "num_steps",
    "slot_ids",
    "temperature",
    "top_k",
    "top_p",
    "end_ids",
    "min_tokens_left",
    "seeds",
)
FLOAT_FIELDS = ("temperature", "top_p")  # staged as their float32 bits
ONE_BITS = int(np.float32(1.0).view(np.int32))  # a padding row's top_p: off
# Logits-sized float32 buffers alive at once while a program chooses its tokens: the
# logits, the end-blocked copy, the scores, the noise and its int64 hashes (two each), and
# top-p's sort (values and order).
LOGITS_WORKSPACE = 8


def rows_bucket(rows: int, num_slots: int) -> int:
    """The rows a call is padded to: the next power of two, at most num_slots."""
    return min(1 << (rows - 1).bit_length(), num_slots)


def keys_bucket(keys: int, max_length: int) -> int:
    """The key positions a call attends over: the next power of two from MIN_KEYS_BUCKET,
    at most max_length (positions past a token's own are masked)."""
    return min(max(MIN_KEYS_BUCKET, 1 << (keys - 1).bit_length()), max_length)


@dataclass
class Transfers:
    """Host <-> device copies of the padded programs' calls."""

    uploads: int = 0
    downloads: int = 0


TRANSFERS = Transfers()


def to_device(host: torch.Tensor, device_buffer: torch.Tensor) -> None:
    """The call's one upload: its staging buffer into the program's inputs (asynchronous
    from pinned memory; the call's download waits for the device anyway)."""
    TRANSFERS.uploads += 1
    device_buffer.copy_(host, non_blocking=host.is_pinned())


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The call's one download: a copy (the next replay rewrites a graph's output)."""
    TRANSFERS.downloads += 1
    return tensor.to("cpu", copy=True).numpy()


@dataclass(frozen=True)
class CallKey:
    """What a graph fixes: the role and shapes of a padded call, and its sampling work."""

    role: str  # "target" or "draft"
    rows: int  # a rows_bucket
    width: int  # tokens per row: the call's widest row
    keys: int  # a keys_bucket
    num_steps: int  # draft: k (at least 1); target: width
    filters: Filters | None  # None: every row is greedy
    hindsight: bool  # draft: some row guesses its fed tokens (logits at every position)


@dataclass
class CallProgram:
    key: CallKey
    host: torch.Tensor  # (len(ROW_FIELDS) * rows + rows * width,) int64 staging buffer
    inputs: torch.Tensor  # the same on the device: what the program reads
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # where the graph writes its tokens


def call_filters(batch: EngineBatch, vocab_size: int) -> Filters | None:
    """The sampling filters of a call's sampled rows, from the host's arrays (None: every
    row is greedy). Top-k's width is a power of two, so calls with nearby k share graphs."""
    sampled = batch.temperature > 0
    if not sampled.any():
        return None
    largest_k = int(batch.top_k[sampled].max())
    size = 0 if largest_k <= 0 else min(1 << (largest_k - 1).bit_length(), vocab_size)
    return Filters(size, bool((batch.top_p[sampled] < 1).any()))


def fits(batch: EngineBatch, role: str) -> np.ndarray:
    """(B,) bool: the rows a padded program takes. Longer rows (prefill), rows that ask
    for log-probabilities and rows with logit controls (specdec/engines/controls.py: their
    work depends on their history) run eagerly."""
    short = (batch.input_lengths <= MAX_BATCHED_QUERY) & ~batch.has_controls()
    if role == "target":
        return short & ~batch.wants_log_probs()
    return short


class CallGraphs:
    """The padded programs of one LlamaEngine, keyed by CallKey, each captured as a CUDA
    graph on first use (capture=True, CUDA only) or run as it is (capture=False)."""

    def __init__(self, engine: LlamaEngine, capture: bool = True) -> None:
        self.engine = engine
        self.capture = capture
        self.programs: dict[CallKey, CallProgram] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captured_bytes = 0

    def pool_bytes(self) -> int:
        """Bytes the device's allocator reserved while this engine's graphs were captured:
        what their shared pool holds (0 without graphs)."""
        return self.captured_bytes

    @torch.inference_mode()
    def run(self, role: str, batch: EngineBatch) -> np.ndarray:
        """(B, columns) int64 for a call whose every row fits: target, each row's tokens at
        its last num_steps positions (columns: width); draft, its k proposals, then (where a
        row guesses in hindsight) the argmax after each of its fed tokens (columns: k +
        width). Columns past a row's own hold anything."""
        key = self.key(role, batch)
        program = self.programs.get(key) or self._prepare(key)
        self._stage(program, batch)
        to_device(program.host, program.inputs)
        if program.graph is None:
            output = self._execute(program)
        else:
            program.graph.replay()
            assert program.output is not None
            output = program.output
        return to_host(output)[: len(batch.slot_ids)]

    def key(self, role: str, batch: EngineBatch) -> CallKey:
        engine = self.engine
        width = int(batch.input_lengths.max())
        ends = batch.cache_lengths.astype(np.int64) + batch.input_lengths
        hindsight = False
        num_steps = width
        if role == "draft":  # a draft step feeds each token back at its own position
            ends = ends + np.maximum(batch.num_steps.astype(np.int64) - 1, 0)
            num_steps = max(int(batch.num_steps.max()), 1)
            hindsight = bool(hindsight_lengths(batch.input_lengths, batch.temperature).any())
        return CallKey(
            role=role,
            rows=rows_bucket(len(batch.slot_ids), engine.num_slots),
            width=width,
            keys=keys_bucket(int(ends.max()), engine.max_length),
            num_steps=num_steps,
            filters=call_filters(batch, engine.config.vocab_size),
            hindsight=hindsight,
        )

    def _prepare(self, key: CallKey) -> CallProgram:
        """A program's buffers, its inputs all padding rows (a capture writes nothing but
        spare positions), and its graph."""
        size = len(ROW_FIELDS) * key.rows + key.rows * key.width
        pinned = self.engine.device.type == "cuda"
        inputs = torch.zeros(size, dtype=torch.int64, device=self.engine.device)
        fields = inputs[: len(ROW_FIELDS) * key.rows].view(len(ROW_FIELDS), key.rows)
        fields[ROW_FIELDS.index("slot_ids")] = torch.arange(key.rows, device=inputs.device)
        fields[ROW_FIELDS.index("top_p")] = ONE_BITS
        fields[ROW_FIELDS.index("end_ids")] = -1
        host = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
        program = CallProgram(key, host, inputs)
        if self.capture:
            self._capture(program)
        self.programs[key] = program
        return program

    def _capture(self, program: CallProgram) -> None:
        """Warms up on a side stream (cuBLAS handles, kernel choices), then captures into the
        engine's pool."""
        device = self.engine.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._execute(program)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.memory_reserved(device)
        with torch.cuda.graph(graph, pool=self.pool):
            program.output = self._execute(program)
        self.captured_bytes += torch.cuda.memory_reserved(device) - before
        program.graph = graph

    def _stage(self, program: CallProgram, batch: EngineBatch) -> None:
        """The call's inputs into the program's staging buffer: real rows first, then
        padding rows in slots no row holds (no tokens: every position a spare one)."""
        key, num_rows = program.key, len(batch.slot_ids)
        host = program.host.numpy()
        fields = host[: len(ROW_FIELDS) * key.rows].reshape(len(ROW_FIELDS), key.rows)
        fields[:] = 0
        for i, name in enumerate(ROW_FIELDS):
            values = getattr(batch, name)
            if name in FLOAT_FIELDS:
                values = values.astype(np.float32).view(np.int32)
            fields[i, :num_rows] = values
        free = np.setdiff1d(np.arange(self.engine.num_slots), batch.slot_ids)
        fields[ROW_FIELDS.index("slot_ids"), num_rows:] = free[: key.rows - num_rows]
        fields[ROW_FIELDS.index("top_p"), num_rows:] = ONE_BITS
        fields[ROW_FIELDS.index("end_ids"), num_rows:] = -1
        tokens = host[len(ROW_FIELDS) * key.rows :].reshape(key.rows, key.width)
        tokens[:] = 0
        real = np.arange(key.width) < batch.input_lengths[:, None]  # (B, width)
        tokens[:num_rows][real] = batch.input_ids

    def _execute(self, program: CallProgram) -> torch.Tensor:
        """The program on the device, from its inputs alone (what a graph captures)."""
        key = program.key
        split = len(ROW_FIELDS) * key.rows
        rows = program.inputs[:split].view(len(ROW_FIELDS), key.rows)
        fields = {name: rows[i] for i, name in enumerate(ROW_FIELDS)}
        for name in FLOAT_FIELDS:
            fields[name] = fields[name].to(torch.int32).view(torch.float32)
        tokens = program.inputs[split:]  # (rows * width,) row by row
        if key.role == "target":
            return self._target(key, fields, tokens)
        return self._draft(key, fields, tokens)

    def _positions(self, fields: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """(rows * width,) each token's position: its row's next ones, and past a row's
        tokens a spare position beyond max_length."""
        steps = torch.arange(width, device=self.engine.device)
        real = steps < fields["input_lengths"][:, None]  # (rows, width)
        own = fields["cache_lengths"][:, None] + steps
        return torch.where(real, own, self.engine.max_length + steps).reshape(-1)

    def _target(self, key: CallKey, fields: dict[str, torch.Tensor], tokens) -> torch.Tensor:
        """(rows, width) the target's tokens: column s of row r chooses after its token
        input_lengths - num_steps + s (columns from num_steps on repeat its last)."""
        rows, width = key.rows, key.width
        steps = torch.arange(width, device=tokens.device)
        fed = fields["input_lengths"]
        first = (fed - fields["num_steps"])[:, None] + steps  # (rows, width) in-row index
        in_row = torch.minimum(first, (fed - 1)[:, None]).clamp(min=0)
        picks = (torch.arange(rows, device=tokens.device)[:, None] * width + in_row).reshape(-1)
        logits = self.engine.padded_logits(
            tokens, self._positions(fields, width), fields["slot_ids"], width, key.keys, picks
        )  # (rows * width, V)
        chosen_at = (fields["cache_lengths"][:, None] + first + 1).reshape(-1)
        sampling, seeds = step_sampling(fields, steps.expand(rows, width))
        chosen = choose_tokens_dense(logits, sampling, seeds, chosen_at, key.filters)
        return chosen.view(rows, width)

    def _draft(self, key: CallKey, fields: dict[str, torch.Tensor], tokens) -> torch.Tensor:
        """(rows, k [+ width]): each row's k proposals, then (hindsight) the argmax after
        each of its fed tokens. A row's step s past its num_steps writes a spare position."""
        engine, rows, width = self.engine, key.rows, key.width
        fed, slots = fields["input_lengths"], fields["slot_ids"]
        last = torch.arange(rows, device=tokens.device) * width + (fed - 1).clamp(min=0)
        positions = self._positions(fields, width)
        picks = None if key.hindsight else last
        logits = engine.padded_logits(tokens, positions, slots, width, key.keys, picks)
        guesses = None
        if key.hindsight:  # logits at every position: the guesses, then each row's last
            guesses = logits.argmax(dim=-1).view(rows, width)
            logits = logits.index_select(0, last)  # (rows, V)
        base = fields["cache_lengths"] + fed  # the first proposal's position
        token = self._choose_step(key, fields, logits, 0, base)
        proposals = [token]
        for step in range(1, key.num_steps):
            active = step < fields["num_steps"]
            at = torch.where(active, base + step - 1, engine.max_length)
            logits = engine.padded_logits(token, at, slots, 1, key.keys, None)  # (rows, V)
            token = self._choose_step(key, fields, logits, step, base + step)
            proposals.append(token)
        chosen = torch.stack(proposals, dim=1)  # (rows, k)
        return chosen if guesses is None else torch.cat([chosen, guesses], dim=1)

    def _choose_step(self, key, fields, logits, step: int, positions) -> torch.Tensor:
        """(rows,) the draft's tokens at its step `step` (positions: (rows,) theirs)."""
        steps = torch.full((key.rows, 1), step, device=logits.device)
        sampling, seeds = step_sampling(fields, steps)
        return choose_tokens_dense(logits, sampling, seeds, positions, key.filters)


def step_sampling(
    fields: dict[str, torch.Tensor], steps: torch.Tensor
) -> tuple[RowSampling, torch.Tensor]:
    """Sampling parameters and seeds (rows * S,) for logits rows taken at the `steps`
    (rows, S) of each row of this call (the end token blocked below min_tokens_left)."""
    num_rows, width = steps.shape

    def repeated(name: str) -> torch.Tensor:
        return fields[name][:, None].expand(num_rows, width).reshape(-1)

    sampling = RowSampling(
        temperature=repeated("temperature"),
        top_k=repeated("top_k"),
        top_p=repeated("top_p"),
        end_id=repeated("end_ids"),
        block_end=(steps < fields["min_tokens_left"][:, None]).reshape(-1),
    )
    return sampling, repeated("seeds")


def graph_pool_bytes_estimate(
    config: LlamaConfig, num_slots: int, max_width: int, dtype: torch.dtype, max_length: int
) -> int:
    """An estimate, not a bound, of the most one engine's graph pool should need: the
    activations of its largest padded call (num_slots rows of max_width tokens attending
    over max_length keys), whose logits and sampling buffers dominate (LOGITS_WORKSPACE
    float32 buffers of rows x width x vocab). The graphs share the pool, and the captures
    run one after another, so it holds about the largest call's peak; fragmentation comes
    on top."""
    c = config
    tokens = num_slots * max_width
    size = torch.empty((), dtype=dtype).element_size()
    logits = LOGITS_WORKSPACE * tokens * c.vocab_size * 4
    per_token = (
        4 * c.hidden_size * 4  # residual stream, norm and projections' float32 outputs
        + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * size * 2  # q, k, v, rotated
        + 3 * c.intermediate_size * size  # gate and up, their product
    )
    group = c.num_heads // c.num_kv_heads
    attention = num_slots * max_width * max_length * (group * size + c.num_heads * 4)
    return logits + tokens * per_token + attention
