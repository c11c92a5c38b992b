"""Llama-family decoder over a slot-addressed static KV cache: the `torch` Engine (engine.py).

The engine keeps one cache for many sequences. A sequence is addressed by its slot and by
how many positions of that slot are valid (`cache_lengths`); new tokens are written right
after them. Rolling back rejected draft tokens is only a shorter cache length next call.

Calls are packed: the new tokens of every row are concatenated into one (N,) tensor, so the
linear layers (where the time goes on CPU) see one matrix, and only attention runs per row.
Attention reads the slot cache in place: new keys and values are written into their slots
(forward), and rows read them through a view of the slot range they span
(`_batched_attention`, `_row_attention`); only rows scattered over far more slots than they
fill read a copy of their own slots.

On CUDA, `cuda_graphs` runs the engine calls (calls.py) as padded programs replayed from
CUDA graphs (graphs.py, CallGraphs): the target's verify and the draft's whole call, each
one graph keyed by its shapes. They run the same decoder (`_decode`) through
`padded_logits`: every row padded to the call's widest, padding rows in free slots,
padding tokens writing spare positions past max_length (the cache reserves
SPARE_POSITIONS per slot), masks made on the device. On the CPU the engine runs exact
shapes eagerly; the padded programs run there only in tests (capture=False).

Precision (`dtype`): the matrices (the head too), the attention and the KV cache compute in
float32, bfloat16 or float16 (CUDA); the residual stream and the norms stay float32, and the
head's top logits are recomputed in float32, so they are not rounded to bfloat16's coarse
steps, where the top two would often tie.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
import torch.nn.functional as F

from specdec.engines.engine import MAX_BATCHED_QUERY, SlotCache, check_rows, full_vocabulary
from specdec.engines.graphs import SPARE_POSITIONS, CallGraphs

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # RoPE scaling (rope_inv_freq): "default", "linear" or "llama3" (Llama 3.1 / 3.2)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope_type=rope_type,
            rope_factor=rope.get("factor", 1.0),
            rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
            rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
            rope_original_max_positions=rope.get("original_max_position_embeddings", 8192),
        )


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's *.safetensors files (shards in name order)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32):
    """Reads a Hugging Face Llama-family directory (config.json + safetensors)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    if hf.get("model_type") not in {"llama", "mistral", "qwen2"}:
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not Llama-family")
    state = read_safetensors(path)
    if not state:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    return LlamaConfig.from_hf(hf), {
        k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()
    }


def rope_inv_freq(c: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,), float32, with linear or Llama 3 scaling.

    Llama 3 keeps the high frequencies, divides the low ones (wavelengths longer than the
    original context / low_freq_factor) by the factor, and blends the band in between."""
    exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
    inv_freq = 1.0 / (c.rope_theta**exponents)
    if c.rope_type == "linear":
        return inv_freq / c.rope_factor
    if c.rope_type != "llama3":
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    context = c.rope_original_max_positions
    blend = (context / wavelength - c.rope_low_freq_factor) / (
        c.rope_high_freq_factor - c.rope_low_freq_factor
    )
    blended = (1 - blend) * inv_freq / c.rope_factor + blend * inv_freq
    scaled = torch.where(
        wavelength > context / c.rope_low_freq_factor, inv_freq / c.rope_factor, blended
    )
    return torch.where(wavelength < context / c.rope_high_freq_factor, inv_freq, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


HEAD_TOKEN_IDS = "draft.head_token_ids"  # optional weight: (head size,) token ids
# A width's rows read their slot range through a view where they fill at least this share of
# it; sparser rows read a gathered copy of their own slots: the masked slots of a view cost
# what real ones do, and a copy costs about what a quarter more slots do (measured:
# docs/benchmarks-archive.md, "2026-12-05 (afternoon)"). Rows spread out as requests join and
# leave: a freed slot keeps its prefix for reuse, so the next request takes a slot above the
# running ones.
VIEW_MIN_FILL = 0.8
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Top logits per position that the head recomputes in float32 below float32 (head_logits):
# the true top two are among them unless more than this many round to the same top value.
RESCORED_LOGITS = 16


class LayerWeights(TypedDict):
    """One decoder layer: matrices in the compute dtype (q, k, v as one; gate, up as one),
    norms in float32."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None  # None: the checkpoint has no q, k, v biases
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor


@dataclass
class BatchedAttention:
    """Rows that add the same number of tokens, attending in one call."""

    # The cache slots the call reads: a range (read through a view; slots in it that are not
    # the call's are masked), or the rows' own slots, gathered (M / width of them).
    slots: slice | torch.Tensor
    span: int  # slots read
    width: int  # query positions per slot: every row's new tokens
    keys: int  # key positions read (the longest row's total length)
    sources: torch.Tensor  # (M,) packed token index of each query
    dests: torch.Tensor  # (M,) its index in the (span * width) layout
    # (span, 1, group * width, keys), added to the scores: 0 where a query may attend, -inf
    # elsewhere (made once per forward; a bool mask is converted in every layer's call).
    mask: torch.Tensor
    # When every slot the call reads is one of its rows (no gaps in the layout): (M,) the
    # packed token at each place of the layout, so queries and outputs move with one gather
    # and one scatter instead of a zeroed padded copy. None otherwise.
    order: torch.Tensor | None = None


@dataclass
class AttentionPlan:
    batched: list[BatchedAttention]  # one call per width
    looped: list[tuple[int, int, int, int]]  # rows alone: (slot, cache length, start, end)


class LlamaEngine(SlotCache):
    """A Llama decoder whose KV cache holds `num_slots` sequences of `max_length` positions."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        num_slots: int,
        max_length: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        cuda_graphs: bool = False,
    ) -> None:
        """dtype: what the matrices (the head too), the attention and the KV cache compute
        in (float32, bfloat16; float16 on CUDA only). The residual stream and the norms stay
        float32 in every dtype (see forward); below float32 each position's top
        RESCORED_LOGITS logits are recomputed in float32 (head_logits).
        cuda_graphs (CUDA only): the calls of calls.py run as padded programs replayed from
        CUDA graphs (call_graphs: graphs.CallGraphs)."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {dtype}: expected one of {COMPUTE_DTYPES}")
        if dtype == torch.float16 and torch.device(device).type == "cpu":
            raise ValueError("float16 runs on CUDA only; on the CPU use bfloat16 or float32")
        if cuda_graphs and torch.device(device).type != "cuda":
            raise ValueError(f"cuda_graphs runs on CUDA only, not on {device}")
        self.config = config
        self.num_slots = num_slots
        self.max_length = max_length
        self.device = torch.device(device)
        self.dtype = dtype

        def matrix(name: str) -> torch.Tensor:
            return weights[name].to(self.device, dtype)

        def vector(name: str) -> torch.Tensor:  # norm weights: float32 as the norms are
            return weights[name].to(self.device, torch.float32)

        # The head is a matrix like the others: a float32 copy would slow every step
        # (docs/benchmarks-archive.md, Precision). Its top logits are recomputed in float32
        # (head_logits), so they are not rounded to bfloat16's steps (0.125 near 20) where
        # the top two would tie.
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = matrix(head_name)
        self.embed = (
            self.lm_head if config.tie_word_embeddings else matrix("model.embed_tokens.weight")
        )
        self.rescored_logits = RESCORED_LOGITS
        # A draft's head may score a subset of the vocabulary: these token ids (full_vocabulary)
        self.head_token_ids = weights.get(HEAD_TOKEN_IDS)
        if self.head_token_ids is not None:
            self.head_token_ids = self.head_token_ids.to(self.device).long()
        self.final_norm = vector("model.norm.weight")
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        # Spare positions past max_length: a padded call's padding tokens write their keys
        # and values there (graphs.py); nothing ever reads them.
        super().__init__(config, num_slots, max_length + SPARE_POSITIONS, dtype, self.device)
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.call_graphs = CallGraphs(self) if cuda_graphs else None

    def _layer(self, weights: dict[str, torch.Tensor], i: int) -> LayerWeights:
        """Layer i's matrices in the compute dtype (q, k, v as one; gate, up as one)."""
        p = f"model.layers.{i}."

        def joined(names: list[str]) -> torch.Tensor:
            return torch.cat([weights[p + n] for n in names], 0).to(self.device, self.dtype)

        has_bias = p + "self_attn.q_proj.bias" in weights
        return {
            "qkv": joined([f"self_attn.{n}_proj.weight" for n in "qkv"]),  # one matmul
            "qkv_bias": joined([f"self_attn.{n}_proj.bias" for n in "qkv"]) if has_bias else None,
            "o": weights[p + "self_attn.o_proj.weight"].to(self.device, self.dtype),
            "gate_up": joined(["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
            "down": weights[p + "mlp.down_proj.weight"].to(self.device, self.dtype),
            "attn_norm": weights[p + "input_layernorm.weight"].to(self.device, torch.float32),
            "mlp_norm": weights[p + "post_attention_layernorm.weight"].to(
                self.device, torch.float32
            ),
        }

    def graph_pool_bytes(self) -> int:
        """Bytes this engine's CUDA graphs hold in their shared pool (0 without graphs)."""
        return 0 if self.call_graphs is None else self.call_graphs.pool_bytes()

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        num_slots: int,
        max_length: int,
        device="cpu",
        dtype: torch.dtype = torch.float32,
        cuda_graphs: bool = False,
    ) -> LlamaEngine:
        config, weights = load_hf_checkpoint(path)  # float32; __init__ casts the matrices to dtype
        return cls(config, weights, num_slots, max_length, device, dtype, cuda_graphs)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (N, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.dtype  # q and k's
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # (N, 1, hd)

    def _row_attention(self, li, q, attn, slot, cache_length, start, end) -> None:
        """One row against its own slot: for long rows (prefill)."""
        total = cache_length + (end - start)
        keys = self.k_cache[li, slot, :, :total]  # (kvh, L, hd)
        values = self.v_cache[li, slot, :, :total]
        mask = None
        if end - start > 1:  # causal within the new tokens; all cached positions visible
            query_pos = torch.arange(cache_length, total, device=self.device)
            mask = torch.arange(total, device=self.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None],  # (1, nh, T, hd)
            keys[None],
            values[None],
            attn_mask=mask,
            enable_gqa=self.config.num_heads != self.config.num_kv_heads,
        )
        attn[start:end] = out[0].transpose(0, 1)

    def _plan_attention(self, input_lengths, slot_ids, cache_lengths, starts) -> AttentionPlan:
        """Short rows that add the same number of tokens share one attention call per layer;
        long rows (prefill), and a short row alone at its width, go one by one.

        One call per width, not one padded to the widest row: a call's work grows with its
        width for every row in it, so one row verifying 4 draft tokens in a call of 64
        decoding rows made the whole call attend for 5 positions per row.
        """
        looped = [r for r, n in enumerate(input_lengths) if n > MAX_BATCHED_QUERY]
        by_width: dict[int, list[int]] = {}
        for r, n in enumerate(input_lengths):
            if n <= MAX_BATCHED_QUERY:
                by_width.setdefault(n, []).append(r)
        batched = []
        for width, rows in sorted(by_width.items()):
            if len(rows) < 2:
                looped += rows
            else:
                batched.append(self._batch_rows(rows, width, slot_ids, cache_lengths, starts))
        rows_alone = [(slot_ids[r], cache_lengths[r], starts[r], starts[r + 1]) for r in looped]
        return AttentionPlan(batched, rows_alone)

    def _batch_rows(self, rows, width, slot_ids, cache_lengths, starts) -> BatchedAttention:
        """One call for `rows`, each adding `width` tokens. Rows whose slots fill at least
        VIEW_MIN_FILL of the range they span read it through a view (no copy; the other slots
        are masked); sparser rows read a gathered copy of their own slots' keys and values.
        Built with whole-array operations: a Python loop over the rows cost more host time
        than a GPU spends on a 64-row verify."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        row_slots = np.asarray([slot_ids[r] for r in rows], dtype=np.int64)
        first, last = int(row_slots.min()), int(row_slots.max())
        slots: slice | torch.Tensor
        if len(rows) >= VIEW_MIN_FILL * (last - first + 1):
            slots, span = slice(first, last + 1), last - first + 1
            place = row_slots - first
        else:
            slots = torch.from_numpy(row_slots).to(self.device)
            span, place = len(rows), np.arange(len(rows))
        cached = np.asarray([cache_lengths[r] for r in rows], dtype=np.int64)
        row_starts = np.asarray([starts[r] for r in rows], dtype=np.int64)
        keys = int(cached.max()) + width
        steps = np.arange(width)
        sources = (row_starts[:, None] + steps).reshape(-1)  # (M,) row by row
        dests = (place[:, None] * width + steps).reshape(-1)
        # Each query sees the keys up to its own position; slots not in the call attend to
        # key 0 only (finite, never read).
        allowed = np.zeros((span, width, keys), dtype=np.bool_)
        allowed[:, :, 0] = True
        limits = cached[:, None] + steps  # (rows, width): each query's position
        allowed[place] = np.arange(keys) <= limits[:, :, None]
        order = None
        if span == len(rows):  # every place of the layout is a row's token
            order = np.empty(len(sources), dtype=np.int64)
            order[dests] = sources
        blocked = torch.from_numpy(~allowed)[:, None, None].expand(span, 1, group, width, keys)
        mask = torch.zeros(blocked.shape, dtype=self.dtype).masked_fill_(blocked, -math.inf)
        return BatchedAttention(
            slots=slots,
            span=span,
            width=width,
            keys=keys,
            sources=torch.from_numpy(sources).to(self.device),
            dests=torch.from_numpy(dests).to(self.device),
            mask=mask.reshape(span, 1, group * width, keys).to(self.device),
            order=torch.from_numpy(order).to(self.device) if order is not None else None,
        )

    def _batched_attention(self, li, q, attn, b: BatchedAttention) -> None:
        c = self.config
        group = c.num_heads // c.num_kv_heads
        if b.order is not None:
            laid_out = q.index_select(0, b.order)  # (span * width, nh, hd)
        else:
            laid_out = q.new_zeros(b.span * b.width, c.num_heads, c.head_dim)
            laid_out.index_copy_(0, b.dests, q[b.sources])
        # (span, width, kvh, group, hd) -> (span, kvh, group * width, hd): a kv head's queries
        # (a view when width is 1)
        queries = laid_out.view(b.span, b.width, c.num_kv_heads, group, c.head_dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(
            b.span, c.num_kv_heads, group * b.width, c.head_dim
        )
        if isinstance(b.slots, slice):  # (span, kvh, L, hd): a view
            keys = self.k_cache[li, b.slots, :, : b.keys]
            values = self.v_cache[li, b.slots, :, : b.keys]
        else:  # the rows' own slots, copied
            keys = self.k_cache[li, :, :, : b.keys].index_select(0, b.slots)
            values = self.v_cache[li, :, :, : b.keys].index_select(0, b.slots)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=b.mask)
        out = out.view(b.span, c.num_kv_heads, group, b.width, c.head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(b.span * b.width, c.num_heads, c.head_dim)
        if b.order is not None:
            attn.index_copy_(0, b.order, out)
        else:
            attn[b.sources] = out[b.dests]

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of float32 hidden states h (M, H). Below float32 the head runs in
        the compute dtype, whose output is rounded to it; then each row's top
        `rescored_logits` are recomputed from the same weights in float32, so that the
        top two differ by what the model computes, not by a rounding step."""
        if self.lm_head.dtype == torch.float32:
            return F.linear(h, self.lm_head)
        logits = F.linear(h.to(self.lm_head.dtype), self.lm_head).float()
        if self.rescored_logits <= 0:
            return logits
        top = logits.topk(min(self.rescored_logits, logits.shape[-1]), dim=-1).indices
        rows = self.lm_head[top].float()  # (M, R, H)
        exact = torch.bmm(rows, h[:, :, None])[:, :, 0]  # (M, R)
        return logits.scatter_(1, top, exact)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) new tokens of all rows, packed
        input_lengths: list[int],  # (B,) new tokens per row, sum N
        slot_ids: list[int],  # (B,)
        cache_lengths: list[int],  # (B,) valid positions already in each slot
        num_logits: list[int],  # (B,) trailing positions per row that need logits
    ) -> torch.Tensor:
        """Appends the rows' tokens to their slots; returns (sum(num_logits), V) logits."""
        check_rows(input_lengths, cache_lengths, num_logits, self.max_length)
        lengths = np.asarray(input_lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        row_starts = ends - lengths
        # Each token's position in its slot: its row's cached length + its index in the row.
        packed = np.arange(int(ends[-1]))
        offsets = np.asarray(cache_lengths, dtype=np.int64) - row_starts
        positions = torch.from_numpy(packed + np.repeat(offsets, lengths)).to(self.device)
        slots = np.repeat(np.asarray(slot_ids, dtype=np.int64), lengths)
        token_slots = torch.from_numpy(slots).to(self.device)
        starts = [0, *ends.tolist()]
        plan = self._plan_attention(input_lengths, slot_ids, cache_lengths, starts)
        # The last num_logits[r] tokens of each row r: pick j of row r is token
        # ends[r] - wanted[r] + (j - picks before row r) = j + ends[r] - cumsum(wanted)[r].
        wanted = np.asarray(num_logits, dtype=np.int64)
        shifts = np.repeat(ends - np.cumsum(wanted), wanted)
        picks = torch.from_numpy(np.arange(int(wanted.sum())) + shifts).to(self.device)
        return self._decode(input_ids.to(self.device), positions, token_slots, plan, picks)

    def key_limits(self, positions: torch.Tensor) -> torch.Tensor:
        """The last key position each token of a padded call sees: its own; a padding
        token's (past max_length) key 0, so its softmax stays finite."""
        return torch.where(positions < self.max_length, positions, 0)

    def padded_logits(
        self,
        input_ids: torch.Tensor,  # (rows * width,) every row's tokens, padded to width
        positions: torch.Tensor,  # (rows * width,) past max_length: a padding token
        row_slots: torch.Tensor,  # (rows,) distinct slots
        width: int,
        keys: int,  # key positions attended over (masked past each token's own)
        picks: torch.Tensor | None,  # (M,) the tokens whose logits are returned; None: all
    ) -> torch.Tensor:
        """(M, V) logits of a padded call (graphs.py), from its inputs alone: the masks
        are made on the device, so a CUDA graph replays it whole. Attention is in place
        (a view of every slot, each row's queries in its own slot's place) where the rows
        fill at least half the slots, else over a copy of their slots (a graph cannot
        follow the slot range a call happens to span)."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        rows, device = row_slots.shape[0], self.device
        steps = torch.arange(width, device=device)
        token_slots = row_slots[:, None].expand(rows, width).reshape(-1)
        limits = self.key_limits(positions).view(rows, width)
        index = torch.arange(rows * width, device=device)
        span, dests = rows, index
        order: torch.Tensor | None = index
        slots_read: slice | torch.Tensor = row_slots
        in_place = 2 * rows >= self.num_slots
        if in_place:  # slots no row holds see key 0 (never read)
            span, order, slots_read = self.num_slots, None, slice(0, self.num_slots)
            dests = (row_slots[:, None] * width + steps).reshape(-1)
            limits = limits.new_zeros(span, width).index_copy_(0, row_slots, limits)
        allowed = torch.arange(keys, device=device) <= limits[:, :, None]  # (span, width, keys)
        mask = torch.zeros(span, 1, group, width, keys, dtype=self.dtype, device=device)
        mask.masked_fill_(~allowed[:, None, None], -math.inf)
        attention = BatchedAttention(
            slots=slots_read,
            span=span,
            width=width,
            keys=keys,
            sources=index,
            dests=dests,
            mask=mask.view(span, 1, group * width, keys),
            order=order,
        )
        plan = AttentionPlan([attention], [])
        return self._decode(input_ids, positions, token_slots, plan, picks)

    def _decode(
        self, input_ids, positions, token_slots, plan: AttentionPlan, picks
    ) -> torch.Tensor:
        """The decoder over packed tokens (N,) at `positions` of slots `token_slots`: writes
        their keys and values, attends as `plan` says, and returns the logits of the tokens
        `picks` selects ((M,) indices; None: every token) as (M, V). Nothing here waits for
        the device, so a CUDA graph can capture it (graphs.py)."""
        c = self.config
        n = input_ids.shape[0]
        cos, sin = self._rope(positions)
        # The residual stream x and the norms stay float32 in every dtype: the matrices read
        # their input in the compute dtype and their outputs are added back in float32.
        dtype = self.dtype
        x = F.embedding(input_ids, self.embed).float()  # (N, H)
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps).to(dtype)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])  # (N, q + 2 kv), compute dtype
            qk = qkv[:, : q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = qk * cos + rotate_half(qk) * sin  # q's heads and k's, rotated together
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_size + kv_size :].view(n, c.num_kv_heads, c.head_dim)
            self.k_cache[li][token_slots, :, positions] = k  # (N, kvh, hd)
            self.v_cache[li][token_slots, :, positions] = v
            attn = torch.empty_like(q)  # (N, nh, hd)
            for batch in plan.batched:
                self._batched_attention(li, q, attn, batch)
            for slot, cache_length, start, end in plan.looped:
                self._row_attention(li, q, attn, slot, cache_length, start, end)
            x.add_(F.linear(attn.reshape(n, q_size), layer["o"]))  # float32 += compute dtype
            h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps).to(dtype)
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x.add_(F.linear(F.silu(gate) * up, layer["down"]))

        h = rms_norm(x if picks is None else x[picks], self.final_norm, c.rms_norm_eps)
        logits = self.head_logits(h)  # (M, V or head size)
        return full_vocabulary(logits, self.head_token_ids, c.vocab_size)  # (M, V)
