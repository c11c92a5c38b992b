"""Scripted engines for unit tests of the loop: a deterministic 'language model' over ints.

Each fake keeps a real per-slot cache of token lists and computes its answer from what the
cache holds, so wrong cache bookkeeping in the scheduler gives wrong tokens. Sampled rows
(temperature > 0) get distributions that depend on the context too: the target's over three
tokens around its greedy token, the draft's over three around its guess (one the target
never emits). Both draw from them as the real engines do, by Gumbel-max with the row's seed
and the token's position (specdec/engines/coupling.py), so a draw after the wrong prefix or
at the wrong position changes the law of what the loop emits (tests/test_scheduler.py
counts it).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.engines.coupling import gumbel_argmax
from specdec.engines.wire import EngineBatch, EngineResult, hindsight_lengths

VOCAB = 50


def oracle_next(tokens: list[int]) -> int:
    """The target's greedy next token."""
    return (tokens[-1] * 7 + len(tokens) * 3 + 1) % VOCAB


def copying_oracle(tokens: list[int]) -> int:
    """A target that repeats the last 7 tokens: its output copies its prompt (patched in as
    `oracle_next` by the prompt-lookup tests)."""
    return tokens[-7] if len(tokens) >= 7 else (tokens[-1] + 1) % VOCAB


def draft_guess(tokens: list[int]) -> int:
    """A draft that agrees with the oracle except at every third length."""
    right = oracle_next(tokens)
    return right if len(tokens) % 3 else (right + 1) % VOCAB


# Sampled rows: offsets from the greedy token (the target) or the guess (the draft), and
# their probabilities. The draft's +3 is outside the target's support.
TARGET_SPREAD = ((0, 0.5), (1, 0.3), (2, 0.2))
DRAFT_SPREAD = ((0, 0.4), (1, 0.2), (3, 0.4))


def target_distribution(tokens: list[int]) -> np.ndarray:
    """(VOCAB,) the target's next-token distribution of a sampled row."""
    probs = np.zeros(VOCAB, dtype=np.float32)
    for offset, p in TARGET_SPREAD:
        probs[(oracle_next(tokens) + offset) % VOCAB] = p
    return probs


def draft_distribution(tokens: list[int]) -> np.ndarray:
    probs = np.zeros(VOCAB, dtype=np.float32)
    for offset, p in DRAFT_SPREAD:
        probs[(draft_guess(tokens) + offset) % VOCAB] = p
    return probs


def oracle_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(oracle_next(tokens))
    return tokens[len(prompt) :]


class FakeEngines:
    def __init__(self, num_slots: int, fail_on_call: int | None = None) -> None:
        self.draft_cache: dict[int, list[int]] = {s: [] for s in range(num_slots)}
        self.target_cache: dict[int, list[int]] = {s: [] for s in range(num_slots)}
        self.calls: list[tuple[str, int]] = []  # (role, batch size)
        self.input_lengths: list[tuple[str, list[int]]] = []  # (role, tokens fed per row)
        self.copies: list[tuple[int, int, int]] = []  # (source slot, slot, positions)
        self.fail_on_call = fail_on_call

    def _append(self, cache, batch: EngineBatch) -> list[list[int]]:
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            self.fail_on_call = None  # fail once
            raise RuntimeError("scripted engine failure")
        for src, dst, length in zip(
            batch.copy_src_slots, batch.copy_dst_slots, batch.copy_lengths, strict=True
        ):
            cache[int(dst)] = cache[int(src)][: int(length)]
            self.copies.append((int(src), int(dst), int(length)))
        rows, start = [], 0
        for slot, length, cached in zip(
            batch.slot_ids, batch.input_lengths, batch.cache_lengths, strict=True
        ):
            held = cache[int(slot)]
            assert cached <= len(held), "cache length beyond what the slot holds"
            del held[int(cached) :]
            held.extend(batch.input_ids[start : start + length].tolist())
            start += length
            rows.append(held)
        return rows

    def draft(self, batch: EngineBatch) -> EngineResult:
        rows = self._append(self.draft_cache, batch)
        self.calls.append(("draft", len(rows)))
        self.input_lengths.append(("draft", batch.input_lengths.tolist()))
        out = np.full((len(rows), int(batch.num_steps.max())), -1, dtype=np.int32)
        guessed = hindsight_lengths(batch.input_lengths, batch.temperature)
        hits = np.zeros(len(rows), dtype=np.int64)
        for r, held in enumerate(rows):
            for j in range(guessed[r]):  # each of the last fed tokens, from those before it
                fed_at = len(held) - guessed[r] + j
                hits[r] |= int(draft_guess(held[:fed_at]) == held[fed_at]) << j
            for step in range(int(batch.num_steps[r])):
                token = draft_guess(held)
                if batch.temperature[r] > 0:
                    token = sample(draft_distribution(held), int(batch.seeds[r]), len(held))
                out[r, step] = token
                if step + 1 < batch.num_steps[r]:
                    held.append(token)  # fed, as the real draft does
        return EngineResult(out, hits if guessed.any() else np.zeros(0, dtype=np.int64))

    def target(self, batch: EngineBatch) -> EngineResult:
        rows = self._append(self.target_cache, batch)
        self.calls.append(("target", len(rows)))
        self.input_lengths.append(("target", batch.input_lengths.tolist()))
        out = np.full((len(rows), int(batch.num_steps.max())), -1, dtype=np.int32)
        for r, held in enumerate(rows):
            n = int(batch.num_steps[r])
            for j in range(n):
                prefix = held[: len(held) - n + 1 + j]
                if batch.temperature[r] > 0:
                    out[r, j] = sample(
                        target_distribution(prefix), int(batch.seeds[r]), len(prefix)
                    )
                else:
                    out[r, j] = oracle_next(prefix)
        result = EngineResult(out)
        if batch.wants_log_probs().any():  # a log-probability that depends on the prefix only
            result.log_probs = np.where(out >= 0, -0.01 * (out + 1), 0).astype(np.float32)
        return result


def sample(probs: np.ndarray, seed: int, position: int) -> int:
    """The token at `position` drawn from `probs` with the sequence's noise, as the real
    engines draw (the draft and the target alike)."""
    with np.errstate(divide="ignore"):  # log(0) = -inf: never drawn
        scores = torch.from_numpy(np.log(probs))[None]
    return int(gumbel_argmax(scores, torch.tensor([seed]), torch.tensor([position]))[0])


def fake_decode(token_ids) -> str:
    return "".join(chr(ord("a") + t % 26) for t in token_ids)
