"""Guided decoding: a request's grammar (any JSON, a JSON schema, a regex, an EBNF grammar or
an xgrammar structural tag) as a mask on the logits at every position an engine chooses.

Where the state lives. A grammar's state is a function of the tokens the row wrote since its
output began, so, like the penalties (specdec/engines/controls.py), nothing of it is kept as
the record anywhere: each call sends, for a guided row, its guide (type and text), the
position its output starts, and the tokens from there to the row's cache length
(EngineBatch.history_*). At the logits that choose position j the engine masks every token
the grammar forbids after the tokens before j: the row's cache, and this call's own tokens
before j (the pending ones and the proposals j is conditioned on). A draft masks its own
steps the same way, so its proposals follow the grammar too. Acceptance and rollback reach
the grammar through the tokens alone: a rejected proposal is not among the next call's
tokens, so the state before it is what the next call asks for.

What is cached, and why it may be: matchers positioned along rows (PositionedMatchers), keyed
by the engine's role and the slot, each remembering the tokens it consumed. A call whose
tokens extend a matcher's advances it; one that parts from them (rejected proposals, a new
request in the slot) rolls it back to where they part, and advances it from there. The cache
changes what a call costs, never what it masks.
Compiled grammars are xgrammar's compiler cache, bounded by GRAMMAR_CACHE_BYTES.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

# A guide as the engines take it: (type, text), e.g. ("json_schema", '{"type": ...}'); the
# types are specdec/text/request.py's GUIDE_TYPES.
Guide = tuple[str, str]

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept (xgrammar's compiler cache)
BITS = 32  # tokens per word of a bitmask (xgrammar's int32 words)
# Where JSON (the `json` and `json_schema` guides) may put whitespace between its tokens:
# `compact`: one space after each comma and colon, none elsewhere ({"a": 1, "b": [2, 3]});
# `any`: any run of spaces, tabs and newlines (xgrammar's default). Compact is the default:
# the grammar then writes every key, quote, colon and comma of a schema's object itself, which
# the grammar proposer offers at no model call, and a small model cannot spend its answer on
# whitespace until max_tokens.
JSON_WHITESPACES = ("compact", "any")
# The `json` guide (any JSON object or array), as a schema where whitespace is compact.
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'


class Grammars:
    """A tokenizer's grammars: compiles guides (cached, bounded) and makes matchers."""

    def __init__(
        self,
        info: xgrammar.TokenizerInfo,
        vocab_size: int,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
        json_whitespace: str = "compact",
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        import xgrammar as xgr

        if json_whitespace not in JSON_WHITESPACES:
            raise ValueError(
                f"json_whitespace: {json_whitespace!r} is not one of {JSON_WHITESPACES}"
            )
        self.info = info
        self.vocab_size = vocab_size
        self.json_whitespace = json_whitespace
        # text -> the tokenizer's tokens for it (no special tokens); None: text can't be
        # proposed, only what the mask forces (jump_forward_tokens)
        self.encode = encode
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=cache_bytes
        )

    @classmethod
    def for_tokenizer(cls, tokenizer_path: str, vocab_size: int, **kw) -> Grammars:
        """The grammars of a Hugging Face tokenizer, over the model's vocab_size tokens."""
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return cls(info, vocab_size, encode=encode, **kw)

    def compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        """The guide compiled (from the cache where it was compiled before); ValueError
        where it is not a valid one of its type, with the compiler's first line of why."""
        kind, text = guide
        compiler = self.compiler
        compact = self.json_whitespace == "compact"
        try:
            if kind == "json" and compact:
                return compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False)
            if kind == "json":
                return compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=not compact)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf_grammar":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
        except Exception as error:  # xgrammar raises RuntimeError, ValueError, ...
            lines = str(error).strip().splitlines()
            raise ValueError(f"not a valid {kind}: {lines[0] if lines else repr(error)}") from error
        raise ValueError(f"unknown guide type {kind!r}")

    def matcher(self, guide: Guide, end_id: int) -> xgrammar.GrammarMatcher:
        """A matcher at the start of the guide's text; end_id is the token that ends it."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(guide), override_stop_tokens=[end_id])

    @property
    def cache_bytes(self) -> int:
        """Bytes of compiled grammars held now."""
        return int(self.compiler.get_cache_size_bytes())


@dataclass
class _Positioned:
    guide: Guide
    end_id: int
    tokens: list[int]  # consumed, in order
    matcher: Any  # xgrammar.GrammarMatcher after `tokens`


class PositionedMatchers:
    """Matchers along rows' text, by key (the engines: a role and a slot, a cache, see
    above; the grammar proposer: a sequence)."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.entries: dict[Hashable, _Positioned] = {}

    def at(self, key: Hashable, guide: Guide, end_id: int, tokens: list[int]):
        """A matcher after `tokens` (the row's output so far), or None where the tokens
        leave the grammar or pass its end (a proposal it forbids, a proposed end token: the
        positions after it are never used)."""
        entry = self.entries.get(key)
        if entry is None or entry.guide != guide or entry.end_id != end_id:
            matcher = self.grammars.matcher(guide, end_id)
            entry = self.entries[key] = _Positioned(guide, end_id, [], matcher)
        consumed = entry.tokens
        common = _common_prefix(consumed, tokens)
        if common == 0 and consumed:
            entry.matcher.reset()
        elif common < len(consumed):
            entry.matcher.rollback(len(consumed) - common)
        del consumed[common:]
        for token in tokens[common:]:
            if entry.matcher.is_terminated() or not entry.matcher.accept_token(int(token)):
                return None
            consumed.append(int(token))
        if entry.matcher.is_terminated():
            return None  # past its end token: nothing after it is used
        return entry.matcher

    def drop(self, key: Hashable) -> None:
        """Forgets the matcher under `key` (its row ended)."""
        self.entries.pop(key, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmin(np.asarray(a[:n]) == np.asarray(b[:n])))


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """(num_rows, words) int32, every token allowed."""
    return torch.full((num_rows, (vocab_size + BITS - 1) // BITS), -1, dtype=torch.int32)


def fill_allowed(matcher, bitmask: torch.Tensor, index: int) -> None:
    """Row `index` of the bitmask: the tokens the grammar allows next (matcher None: all)."""
    if matcher is None:
        bitmask[index] = -1
    else:
        matcher.fill_next_token_bitmask(bitmask, index)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets to -inf, in place, each token its bitmask line forbids in logits rows `rows` (G,)
    int64; bitmask (N, words) int32 on the host, a line per logits row (xgrammar's kernel:
    about a millisecond for 16 rows of 49,152 tokens on 2 cores, where unpacking the bits
    with torch took 20)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask.to(logits.device),
        vocab_size=logits.shape[-1],
        indices=rows.tolist(),
    )


def is_allowed(bitmask: torch.Tensor, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """(G,) bool: whether bitmask lines `rows` allow their tokens (G,)."""
    words = bitmask.numpy().view(np.uint32)[rows, tokens // BITS]
    return (words >> (tokens % BITS).astype(np.uint32)) & 1 == 1


def jump_forward_tokens(grammars: Grammars, matcher, limit: int) -> list[int]:
    """Up to `limit` tokens spelling the text the grammar writes itself after the matcher's
    state (xgrammar's jump-forward string: the rest of a key, `": "`, a closing brace), as
    the tokenizer splits it and as far as the grammar takes those tokens; [] without an
    encoder. The matcher is left after them (the caller rolls back). Unlike forced_tokens
    these are not certain: where the vocabulary spells the text more than one way, the
    target may choose another split."""
    if grammars.encode is None or limit <= 0 or matcher.is_terminated():
        return []
    text = matcher.find_jump_forward_string()
    return advance(matcher, grammars.encode(text)[:limit]) if text else []


def advance(matcher, tokens: list[int]) -> list[int]:
    """The longest prefix of `tokens` the grammar allows, the matcher left after it."""
    kept = []
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            break
        kept.append(int(token))
    return kept


def forced_tokens(matcher, vocab_size: int, limit: int) -> list[int]:
    """Up to `limit` tokens the grammar leaves no choice about after the matcher's state
    (each the only token its mask allows), the matcher left where it was."""
    bitmask = new_bitmask(1, vocab_size)
    forced: list[int] = []
    for _ in range(limit):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].numpy().view(np.uint32)
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1 or words[nonzero[0]] & (words[nonzero[0]] - np.uint32(1)):
            break  # more than one token allowed (or none)
        token = int(nonzero[0]) * BITS + int(words[nonzero[0]]).bit_length() - 1
        if not matcher.accept_token(token):
            break
        forced.append(token)
    if forced:
        matcher.rollback(len(forced))
    return forced
