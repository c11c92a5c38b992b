"""Greedy parity below float32 exactness: the tie-aware rule of the precision contract.

Two numerically different paths through the same model (a verify of k + 1 tokens against
one-token steps; a GPU's kernels against the CPU's; bfloat16 against float32) may pick
different tokens where the reference's two best logits are nearly tied, and only there.

- token_divergences: every position where an output's token (or its end) is not the
  argmax of one-token steps teacher-forced along that output; near_tie() tells the
  excused ones (gap below TIE_MARGIN) from bugs.
- gap_moves / precision_moves: how far a verify, or bfloat16 against float32, moves the
  reference's top-2 gap; build/tie_margin.py measures TIE_MARGIN and PRECISION_MARGIN with
  them (docs/benchmarks-archive.md, Precision).
- greedy_path / find_divergences: greedy text against a reference path, by text, for
  servers that answer text only (build/gpu_check.py).
README, Exactness, and docs/design.md, Precision; tests/test_bfloat16_server.py and
tests/test_precision.py apply the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bfloat16Margins:
    """One way of computing bfloat16: the largest moves build/tie_margin.py measured there,
    and the margins set from them (1.5x, rounded up; docs/benchmarks-archive.md, Precision)."""

    # The reference's top-2 logit gap below which a bfloat16 verify of k + 1 tokens and
    # one-token steps may pick differently, and the largest move of that gap measured.
    verify_move: float
    tie: float
    # Likewise for bfloat16 one-token steps against float32 ones (float32's gap).
    precision_move: float
    precision: float


# How far the moves go depends on the kernels: a CPU without bfloat16 instructions takes
# torch's own (emulated); one with avx512_bf16 oneDNN's bfloat16 kernels (native), whose
# moves on the same prompts went further (0.658 against 0.395 on a verify; both AMD EPYC,
# 2 cores, torch 2.13); one with amx_bf16 oneDNN's AMX kernels, whose moves fall between
# (0.485; Intel Xeon, 2 cores), so that native's margins were more than twice them. A GPU's
# kernels are not measured yet.
MARGINS = {
    "emulated": Bfloat16Margins(verify_move=0.395, tie=0.6, precision_move=0.248, precision=0.375),
    "native": Bfloat16Margins(verify_move=0.658, tie=1.0, precision_move=0.556, precision=0.84),
    "amx": Bfloat16Margins(verify_move=0.485, tie=0.73, precision_move=0.207, precision=0.32),
}


def bfloat16_kind(cpuinfo: str | None = None) -> str:
    """How this CPU computes bfloat16: on AMX tiles (amx_bf16, which oneDNN prefers),
    natively (avx512_bf16) or emulated."""
    from specdec.engines.select import cpu_flags, cpu_has_bf16, read_cpuinfo

    flags = cpu_flags(read_cpuinfo() if cpuinfo is None else cpuinfo)
    if "amx_bf16" in flags:
        return "amx"
    return "native" if cpu_has_bf16(flags) else "emulated"


# This host's: what the tests and tools hold bfloat16 to here.
HOST_MARGINS = MARGINS[bfloat16_kind()]
MEASURED_VERIFY_MOVE = HOST_MARGINS.verify_move
TIE_MARGIN = HOST_MARGINS.tie
MEASURED_PRECISION_MOVE = HOST_MARGINS.precision_move
PRECISION_MARGIN = HOST_MARGINS.precision

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class Divergence:
    """An output position whose token is not the reference's argmax there."""

    position: int  # in the output: 0 = its first token; len(output) = where it ended
    token: int  # the output's token there (the end token where it ended too early)
    expected: int  # the reference's argmax there
    gap: float  # the reference's logit of `expected` minus its logit of `token`

    def near_tie(self, margin: float = TIE_MARGIN) -> bool:
        return self.gap < margin


class SingleSteps:
    """The reference of token_divergences: one-token steps (what plain decoding computes)
    teacher-forced in slot 0 of `engine`, the prompt prefilled in one call. It remembers
    the last sequence it fed, so an output that shares a prefix with the previous one costs
    only the rest; it owns slot 0 (nothing else may write there while it is in use)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fed: list[int] = []  # the tokens in slot 0
        self.logits: list[torch.Tensor] = []  # (V,) float32 after self.fed[:P + i]
        self.prompt_length = 0

    @torch.inference_mode()
    def along(self, prompt_ids: list[int], output_ids: list[int], count: int) -> torch.Tensor:
        """(count, V): the logits that choose output positions 0..count-1, each after
        prompt + output[:position]."""
        wanted = list(prompt_ids) + list(output_ids[: max(count - 1, 0)])
        same = 0
        limit = min(len(wanted), len(self.fed))
        while same < limit and wanted[same] == self.fed[same]:
            same += 1
        if same < len(prompt_ids) or self.prompt_length != len(prompt_ids):
            prompt = torch.tensor(prompt_ids)
            self.logits = [self.engine.forward(prompt, [len(prompt_ids)], [0], [0], [1])[0]]
            self.fed, self.prompt_length = list(prompt_ids), len(prompt_ids)
        else:
            del self.logits[same - len(prompt_ids) + 1 :]
            del self.fed[same:]
        for token in wanted[len(self.fed) :]:
            step = self.engine.forward(torch.tensor([token]), [1], [0], [len(self.fed)], [1])
            self.fed.append(token)
            self.logits.append(step[0])
        return torch.stack(self.logits[:count]).float()


def token_divergences(
    engine,
    prompt_ids: list[int],
    output_ids: list[int],
    end_id: int | None,
    ended: bool,
) -> list[Divergence]:
    """Every position where `output_ids` (the tokens produced, the end token not among
    them) is not the argmax of one-token steps teacher-forced along prompt + output; and,
    where it `ended` with `end_id`, whether the argmax there was the end token. An output
    that runs past a position whose argmax is the end token diverges there. After a
    divergence the reference follows the output, so each later position is checked from
    the output's own prefix. `engine`: an Engine (specdec/engines/engine.py; slot 0), or a
    SingleSteps over one to share its steps between outputs of the same prompt."""
    if ended and end_id is None:
        raise ValueError("ended with the end token, but end_id is None")
    steps = engine if isinstance(engine, SingleSteps) else SingleSteps(engine)
    tokens = list(output_ids) + ([end_id] if ended else [])
    if not tokens:
        return []
    logits = steps.along(prompt_ids, output_ids, len(tokens))  # (count, V)
    chosen = torch.tensor(tokens)
    expected = logits.argmax(dim=-1)
    gaps = logits.max(dim=-1).values - logits.gather(1, chosen[:, None])[:, 0]
    return [
        Divergence(i, tokens[i], int(expected[i]), float(gaps[i]))
        for i in torch.nonzero(expected != chosen).flatten().tolist()
    ]


@torch.inference_mode()
def greedy_top2(
    engine, prompt_ids: list[int], max_tokens: int, stop_id: int | None, slot: int = 0
) -> tuple[list[int], list[int], list[float]]:
    """Plain greedy decoding of one prompt in `slot` of an Engine, one token per
    call, stopping after `stop_id` (None: after max_tokens): per output position the
    argmax, the runner-up and the top-2 logit gap."""
    logits = engine.forward(torch.tensor(prompt_ids), [len(prompt_ids)], [slot], [0], [1])
    ids: list[int] = []
    seconds: list[int] = []
    gaps: list[float] = []
    length = len(prompt_ids)
    for _ in range(max_tokens):
        top = logits[0].float().topk(2)
        ids.append(int(top.indices[0]))
        seconds.append(int(top.indices[1]))
        gaps.append(float(top.values[0] - top.values[1]))
        if ids[-1] == stop_id or len(ids) == max_tokens:
            break
        logits = engine.forward(torch.tensor(ids[-1:]), [1], [slot], [length], [1])
        length += 1
    return ids, seconds, gaps


def greedy_path(
    engine, prompt_ids: list[int], max_tokens: int, eos_token_id: int | None
) -> tuple[list[int], list[float]]:
    """Plain greedy decoding of one prompt in slot 0: the token ids (the end token last,
    where it came) and each one's top-2 logit gap."""
    ids, _, gaps = greedy_top2(engine, prompt_ids, max_tokens, eos_token_id)
    return ids, gaps


# -- measuring the margins ------------------------------------------------------------------


@dataclass(frozen=True)
class GapMove:
    """How far another path moved the reference's top-2 gap at one output position."""

    position: int  # in the output
    gap: float  # the reference's l_a - l_b (a, b: its top two)
    move: float  # |(l_a - l_b) on the other path - gap|
    flipped: bool  # the other path's argmax is not a


def _moves(
    logits: torch.Tensor, positions: list[int], top2: tuple[list[int], list[int], list[float]]
) -> list[GapMove]:
    """logits (len(positions), V) of the other path against the reference's top two."""
    firsts, seconds, gaps = top2
    found = []
    for row, position in enumerate(positions):
        a, b = firsts[position], seconds[position]
        other = float(logits[row, a] - logits[row, b])
        flipped = int(logits[row].argmax()) != a
        found.append(GapMove(position, gaps[position], abs(other - gaps[position]), flipped))
    return found


def verify_chunks(length: int, width: int, offset: int) -> list[tuple[int, int]]:
    """[start, end) of the output tokens each verify feeds, teacher-forcing an output of
    `length` tokens: a first call of `offset` tokens (none if 0), then `width` at a time;
    the last token is never fed (nothing follows it)."""
    edges = [0, *range(offset or width, length - 1, width), length - 1]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


@torch.inference_mode()
def gap_moves(
    engine,
    prompts: list[list[int]],
    outputs: list[list[int]],
    top2s: list[tuple[list[int], list[int], list[float]]],
    widths: list[int],
    offsets: list[int],
) -> list[list[GapMove]]:
    """Row r (slot r of `engine`): prompts[r] prefilled, then outputs[r] fed through
    verifies of widths[r] tokens (the first of offsets[r]), every row in one forward per
    call as the server's target batches them; against the reference's top two of each
    position (greedy_top2 along the same output). Per row, a GapMove for each output
    position 1..n-1 (position 0 comes from the prefill on both paths)."""
    plans = [verify_chunks(len(o), w, f) for o, w, f in zip(outputs, widths, offsets, strict=True)]
    for slot, prompt in enumerate(prompts):
        engine.forward(torch.tensor(prompt), [len(prompt)], [slot], [0], [1])
    moves: list[list[GapMove]] = [[] for _ in prompts]
    for call in range(max(len(plan) for plan in plans)):
        fed = [(r, *plan[call]) for r, plan in enumerate(plans) if call < len(plan)]
        ids = torch.tensor([t for r, a, b in fed for t in outputs[r][a:b]])
        lengths = [b - a for _, a, b in fed]
        slots = [r for r, _, _ in fed]
        starts = [len(prompts[r]) + a for r, a, _ in fed]
        logits = engine.forward(ids, lengths, slots, starts, lengths).float()
        first = 0
        for r, a, b in fed:
            positions = list(range(a + 1, b + 1))
            moves[r] += _moves(logits[first : first + b - a], positions, top2s[r])
            first += b - a
    return moves


def precision_moves(
    engine, prompt_ids: list[int], top2: tuple[list[int], list[int], list[float]]
) -> list[GapMove]:
    """One-token steps of `engine` (slot 0; or a SingleSteps over it) teacher-forced along
    the reference's greedy output (greedy_top2 of another engine: float32's, say): a
    GapMove for every position."""
    steps = engine if isinstance(engine, SingleSteps) else SingleSteps(engine)
    output = top2[0]
    logits = steps.along(prompt_ids, output, len(output))
    return _moves(logits, list(range(len(output))), top2)


# -- by text, for servers that answer text only ------------------------------------------


@dataclass(frozen=True)
class TextDivergence:
    prompt: int  # index of the prompt
    token: int  # the reference's first token that the text does not continue
    gap: float  # the reference's top-2 logit gap there

    def near_tie(self, margin: float = TIE_MARGIN) -> bool:
        return self.gap < margin


def first_divergence(decode: Decode, ids: Sequence[int], text: str) -> int | None:
    """Index of the first of the reference's tokens `ids` whose text `text` does not
    continue; None where it continues all of them."""
    for i in range(len(ids)):
        if not text.startswith(decode(ids[: i + 1])):
            return i
    return None


def find_divergences(
    decode: Decode,
    paths: Sequence[tuple[list[int], list[float]]],
    texts: Sequence[str],
    eos_token_id: int | None,
) -> list[TextDivergence]:
    """Each text against its reference path (greedy_path's ids and gaps; a final end
    token is not text): where it first leaves the path, and how near a tie that was. Text
    only sees the first divergence, and a token whose text is a prefix of another's may
    move it: where the server answers token ids, use token_divergences."""
    found = []
    for prompt, ((ids, gaps), text) in enumerate(zip(paths, texts, strict=True)):
        if ids[-1:] == [eos_token_id]:
            ids = ids[:-1]
        position = first_divergence(decode, ids, text)
        if position is not None:
            found.append(TextDivergence(prompt, position, gaps[position]))
    return found
