"""The engine interface: a decoder over a slot-addressed KV cache, and what engines share.

An engine keeps the keys and values of `num_slots` sequences of up to `max_length`
positions each, in its own memory. A call addresses a sequence by its slot and by how many
positions of that slot are valid (`cache_lengths`); the call's new tokens are written right
after them. Rolling back rejected draft tokens is only a shorter cache length next call;
a prompt prefix is reused by copying it into another slot (`copy_slot`).

`forward` packs the rows of a call: row r's input_lengths[r] new tokens follow the previous
rows' in one (N,) tensor. It returns float32 logits (sum(num_logits), V) on the engine's
device: row r's last num_logits[r] positions, rows in order, over the whole vocabulary
(a draft whose head scores a subset gets -inf elsewhere: full_vocabulary). A row adds at
least one token, fits max_length, and asks for 1 to input_lengths[r] logits (check_rows).

Engines: LlamaEngine (torch, llama.py), OnnxEngine and TrtEngine over GraphEngine
(onnx_engine.py, trt_engine.py). select.create_engine picks one by name; calls.py runs the
wire format's calls on any of them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from specdec.engines.llama import LlamaConfig

MAX_BATCHED_QUERY = 16  # rows with more new tokens than this run (attend) one by one


class Engine(Protocol):
    """What the callers use of an engine: calls.py, the engine models, build/ and tests/.
    mypy checks each engine against it where select.create_engine returns one."""

    config: LlamaConfig  # the decoder's dimensions; config.vocab_size is the logits' V
    num_slots: int  # sequences the cache holds
    max_length: int  # positions per slot

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) new tokens of all rows, packed
        input_lengths: list[int],  # (B,) new tokens per row, sum N
        slot_ids: list[int],  # (B,)
        cache_lengths: list[int],  # (B,) valid positions already in each slot
        num_logits: list[int],  # (B,) trailing positions per row that need logits
    ) -> torch.Tensor:
        """Appends the rows' tokens to their slots; returns (sum(num_logits), V) float32
        logits on the engine's device."""
        ...

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copies the first `length` positions of slot `src` into slot `dst`."""
        ...


def check_rows(
    input_lengths: list[int], cache_lengths: list[int], num_logits: list[int], max_length: int
) -> None:
    """Refuses a call with a row that does not fit: no new tokens, more positions than
    max_length, or logits asked for other than 1 to its new tokens."""
    for length, cached, wanted in zip(input_lengths, cache_lengths, num_logits, strict=True):
        if length <= 0 or cached + length > max_length or not 0 < wanted <= length:
            raise ValueError(
                f"row of {length} new tokens after {cached} cached positions "
                f"({wanted} logits) does not fit max_length {max_length}"
            )


def full_vocabulary(
    logits: torch.Tensor, head_token_ids: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """(M, V) logits from a head's (M, head size). A draft's head may score only a subset of
    the vocabulary (its rows are the token ids `head_token_ids`); every other token gets
    -inf, probability 0, which keeps sampling exact. None: the head is the vocabulary."""
    if head_token_ids is None:
        return logits
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, head_token_ids] = logits
    return full


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A KV cache that reads as zero where nothing was written yet.

    Attention reads never-written positions (slots in a call's slot range that are not in
    the call, positions past a short row, padding) and masks them; a masked NaN still
    poisons the result (0 * NaN), so the cache must not start as whatever the allocator
    hands back. On CPU the zeros come from calloc, whose large blocks are fresh pages:
    memory still follows use.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class SlotCache:
    """An engine's KV cache: keys and values (layers, slots, kv heads, positions, head dim),
    zeroed, and `copy_slot`. Every engine inherits it."""

    def __init__(
        self,
        config: LlamaConfig,
        num_slots: int,
        num_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        c = config
        shape = (c.num_layers, num_slots, c.num_kv_heads, num_positions, c.head_dim)
        self.k_cache = zeroed_cache(shape, dtype, device)
        self.v_cache = zeroed_cache(shape, dtype, device)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copies the first `length` positions of slot `src` into slot `dst`."""
        for cache in (self.k_cache, self.v_cache):
            cache[:, dst, :, :length] = cache[:, src, :, :length]
