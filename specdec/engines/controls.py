"""Logit controls a request sends: repetition, presence and frequency penalties, biases and
bad words (min_p, a filter like top-p, is in specdec/engines/sampling.py).

They change the target's distribution, so speculation stays exact only where every verified
position is processed with the text up to that position (Leviathan et al., arXiv 2211.17192,
hold only for the distribution each position is verified under). At the logits that choose
the token at position j, a penalty counts every token before j: the row's cache, and this
call's own tokens before j (the pending tokens and the proposals that j is conditioned on),
never the token at j. The draft processes its own steps the same way, its proposals so far
included, so it proposes what the processed target would.

Nothing carries over between calls: the loop sends, with each call, the tokens before each
row's cache length that its controls read (EngineBatch.history_*). The counts therefore follow
whatever the loop's sequence holds (prefix reuse, the copies of num_return_sequences, chunked
prefill), and a cancelled row leaves nothing behind. Only the tokens chosen leave the engine.

Processing, in order, as Hugging Face's processors and TensorRT-LLM's sampling do it:
1. biases are added (a banned token: -inf; a bad word's last token is banned where the
   tokens before it end the text);
2. repetition: each token that appeared has a positive logit divided by the penalty and a
   negative one multiplied by it;
3. presence subtracts its penalty once from each token that occurred since the row's
   occurrence_start; frequency subtracts its penalty once per occurrence.
4. a guided row's grammar masks every token it forbids there (specdec/engines/grammar.py):
   its state is the row's output before j, sent and written the same way.
Then sampling.py blocks the end token below min_tokens, and applies temperature, top-k, top-p
and min_p. Where nothing is left to choose (a grammar that allows only the end token below
min_tokens, or only tokens that bad words ban) the position gets NO_TOKEN, and the loop ends
the request with an error that says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specdec.engines.grammar import (
    Guide,
    PositionedMatchers,
    apply_bitmask,
    fill_allowed,
    new_bitmask,
)
from specdec.engines.wire import EngineBatch


@dataclass
class LogitControls:
    """The controls of some logits rows of a call, on the logits' device."""

    rows: torch.Tensor  # (R,) int64: the logits rows they apply to
    token_ids: torch.Tensor  # (R, U) int64: tokens before each row's position (padding repeats)
    appeared: torch.Tensor  # (R, U) bool: counted by the repetition penalty
    occurrences: torch.Tensor  # (R, U) float32: occurrences since occurrence_start
    repetition: torch.Tensor  # (R,) float32
    presence: torch.Tensor  # (R,) float32
    frequency: torch.Tensor  # (R,) float32
    bias_ids: torch.Tensor  # (R, P) int64 (padding: token 0)
    bias_values: torch.Tensor  # (R, P) float32 (padding: 0)
    # Guided rows: their logits rows (G,) int64, and what their grammars allow, (N, words)
    # int32 bitmasks on the host, a line per logits row (specdec/engines/grammar.py).
    guided_rows: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None


@torch.inference_mode()  # engines' logits are inference tensors: changed in place here
def apply_controls(logits: torch.Tensor, controls: LogitControls | None) -> torch.Tensor:
    """(N, V) logits -> float32 logits with each controlled row processed. The call's own
    float32 logits are changed in place (copying a verify's would cost more than the work)."""
    if controls is None:
        return logits
    logits = logits.float()
    if controls.token_ids.shape[1] or controls.bias_ids.shape[1]:
        rows = logits[controls.rows]  # (R, V), a copy
        rows.scatter_add_(1, controls.bias_ids, controls.bias_values)
        if controls.token_ids.shape[1]:
            seen = rows.gather(1, controls.token_ids)  # (R, U)
            repetition = controls.repetition[:, None]
            repeated = torch.where(seen > 0, seen / repetition, seen * repetition)
            seen = torch.where(controls.appeared, repeated, seen)
            occurrences = controls.occurrences
            seen = seen - controls.presence[:, None] * (occurrences > 0).float()
            seen = seen - controls.frequency[:, None] * occurrences
            rows.scatter_(1, controls.token_ids, seen)
        logits[controls.rows] = rows
    if controls.bitmask is not None and controls.guided_rows is not None:
        apply_bitmask(logits, controls.bitmask, controls.guided_rows)
    return logits


class CallControls:
    """One call's controls on the host, per batch row, read from its batch once. `matchers`:
    where guided rows' grammars are positioned, under keys (role, slot)."""

    def __init__(
        self, batch: EngineBatch, matchers: PositionedMatchers | None = None, role: str = ""
    ) -> None:
        self.batch = batch
        self.matchers = matchers
        self.role = role
        self.active = batch.has_controls()  # (B,)
        self.guides: dict[int, tuple[Guide, int]] = {}  # batch row -> (guide, output start)
        if not self.active.any():
            return
        for row, kind, text, start in zip(
            batch.guide_rows, batch.guide_types, batch.guides, batch.guide_starts, strict=True
        ):
            self.guides[int(row)] = ((kind.decode(), text.decode()), int(start))
        if self.guides and matchers is None:
            raise ValueError("a guided row reached an engine call without grammars")
        starts = np.cumsum(batch.input_lengths) - batch.input_lengths
        self.inputs = [
            batch.input_ids[start : start + length]
            for start, length in zip(starts, batch.input_lengths, strict=True)
        ]
        self.history = _by_row(batch.history_rows, batch.history_ids, len(batch.slot_ids))
        self.bias_ids = _by_row(batch.bias_rows, batch.bias_ids, len(batch.slot_ids))
        self.bias_values = _by_row(batch.bias_rows, batch.bias_values, len(batch.slot_ids))
        self.bad_words = _by_row(batch.bad_word_rows, batch.bad_words, len(batch.slot_ids))

    def for_logits(
        self,
        rows: np.ndarray,  # (N,) the batch row of each logits row
        positions: np.ndarray,  # (N,) the position of the token each logits row chooses
        written: Callable[[int], np.ndarray],  # batch row -> the tokens this call wrote to
        # its slot so far, in order (its input, then a draft's proposals)
        logits: torch.Tensor,  # (N, V) the logits they will apply to
    ) -> LogitControls | None:
        """The controls of the logits rows whose batch row has any; None without any."""
        chosen = np.nonzero(self.active[rows])[0]
        if not chosen.size:
            return None
        vocab_size, device = logits.shape[-1], logits.device
        parts = [self._row(int(rows[i]), int(positions[i]), written, vocab_size) for i in chosen]
        batch = self.batch
        guided, bitmask = self._bitmask(rows, chosen, [p[3] for p in parts])
        seen = [p[0] for p in parts]
        token_ids, (appeared, occurrences) = _padded(
            [s[0] for s in seen], [s[1] for s in seen], [s[2] for s in seen]
        )
        bias_ids, (bias_values,) = _padded(
            [p[1] for p in parts], [p[2] for p in parts], repeat=False
        )
        at = rows[chosen]

        def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(values, dtype=dtype).to(device)

        return LogitControls(
            rows=tensor(chosen, torch.int64),
            token_ids=tensor(token_ids, torch.int64),
            appeared=tensor(appeared, torch.bool),
            occurrences=tensor(occurrences, torch.float32),
            repetition=tensor(batch.repetition_penalty[at], torch.float32),
            presence=tensor(batch.presence_penalty[at], torch.float32),
            frequency=tensor(batch.frequency_penalty[at], torch.float32),
            bias_ids=tensor(bias_ids, torch.int64),
            bias_values=tensor(bias_values, torch.float32),
            guided_rows=None if guided is None else tensor(guided, torch.int64),
            bitmask=bitmask,
        )

    def _bitmask(
        self, rows: np.ndarray, chosen: np.ndarray, before: list[tuple[int, np.ndarray]]
    ) -> tuple[np.ndarray | None, torch.Tensor | None]:
        """The guided logits rows among `chosen` (indices into `rows`, each logits row's batch
        row), and a bitmask (N, words) whose line for each is what its grammar allows after
        its output before the position (`before`, per chosen row: its first sequence position
        and tokens from there); (None, None) where no row is guided."""
        lines = [j for j, i in enumerate(chosen) if int(rows[i]) in self.guides]
        if not lines:
            return None, None
        assert self.matchers is not None  # checked in __init__
        bitmask = new_bitmask(len(rows), self.matchers.grammars.vocab_size)
        for j in lines:
            i, row = int(chosen[j]), int(rows[chosen[j]])
            guide, start = self.guides[row]
            first, tokens = before[j]
            key = (self.role, int(self.batch.slot_ids[row]))
            output = tokens[max(start - first, 0) :].tolist()
            matcher = self.matchers.at(key, guide, int(self.batch.end_ids[row]), output)
            fill_allowed(matcher, bitmask, i)
        return chosen[lines], bitmask

    def _row(self, row: int, position: int, written: Callable[[int], np.ndarray], vocab_size: int):
        """Row `row`'s tokens seen before `position` ((ids, appeared, occurrences)), its
        biases there (ids, values), and the tokens before the position (the first one's
        position, the tokens); token ids past a draft's smaller vocabulary are left out."""
        batch = self.batch
        cache_length = int(batch.cache_lengths[row])
        history = self.history[row]
        before = np.concatenate([history, written(row)[: position - cache_length]])
        ids, inverse = np.unique(before, return_inverse=True)
        first_position = cache_length - len(history)
        counted = inverse[max(int(batch.occurrence_start[row]) - first_position, 0) :]
        occurrences = np.bincount(counted, minlength=len(ids)).astype(np.float32)
        appeared = np.full(len(ids), batch.repetition_penalty[row] != 1)
        banned = [
            int(word[-1])
            for word in (w[w >= 0] for w in self.bad_words[row])
            if len(before) >= len(word) - 1
            and np.array_equal(before[len(before) - len(word) + 1 :], word[:-1])
        ]
        bias_ids = np.concatenate([self.bias_ids[row], np.array(banned, dtype=np.int64)])
        bias_values = np.concatenate(
            [self.bias_values[row], np.full(len(banned), -np.inf, dtype=np.float32)]
        )
        penalized = (
            batch.repetition_penalty[row] != 1
            or batch.presence_penalty[row] != 0
            or batch.frequency_penalty[row] != 0
        )
        seen = (ids < vocab_size) & penalized  # a row without penalties counts nothing
        biased = bias_ids < vocab_size
        return (
            (ids[seen], appeared[seen], occurrences[seen]),
            bias_ids[biased],
            bias_values[biased],
            (first_position, before),
        )


def _by_row(rows: np.ndarray, values: np.ndarray, num_rows: int) -> list[np.ndarray]:
    """Entries naming their row (COO) as one array per row, in their order."""
    order = np.argsort(rows, kind="stable")
    bounds = np.searchsorted(rows[order], np.arange(num_rows + 1))
    return [values[order[bounds[r] : bounds[r + 1]]] for r in range(num_rows)]


def _padded(ids: list[np.ndarray], *columns: list[np.ndarray], repeat: bool = True):
    """Rows of different lengths as (R, width) arrays. Padding is token 0 with zeros, which
    an addition leaves unchanged; with `repeat`, a row's padding repeats its first entry
    instead (gathering and scattering it writes the same value twice), and only a row
    without entries gets token 0 with zeros."""
    width = max((len(i) for i in ids), default=0)
    out_ids = np.zeros((len(ids), width), dtype=np.int64)
    outs = [np.zeros((len(ids), width), dtype=c[0].dtype) for c in columns]
    for r, row_ids in enumerate(ids):
        n = len(row_ids)
        out_ids[r, :n] = row_ids
        for out, column in zip(outs, columns, strict=True):
            out[r, :n] = column[r]
        if repeat and n:
            out_ids[r, n:] = row_ids[0]
            for out, column in zip(outs, columns, strict=True):
                out[r, n:] = column[r][0]
    return out_ids, outs
