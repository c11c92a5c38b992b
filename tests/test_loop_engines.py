"""The loop in process with the real engines: `LocalEngines` runs the real target and the
real draft (torch, float32 and bfloat16) with no Triton in between. Rows are greedy and
sampled, drafted by the model, by prompt lookup and adaptively, in batches that requests join
and leave; every output is checked position by position against the target decoding one
token per call (greedy) or the target's own support at each prefix (sampled, top-k).

float32 is exact: greedy output equals the target's one-token-per-call path, token for
token, ends included. bfloat16 may part from it only at near-ties (the precision contract,
build/greedy_parity.py). tests/mutations/run.py plants the bugs these tests must
catch.
"""

from __future__ import annotations

import pytest
import torch

from build.greedy_parity import TIE_MARGIN, token_divergences
from conftest import DRAFT
from specdec.engines.calls import LocalEngines
from specdec.engines.coupling import perturbed_scores
from specdec.engines.llama import LlamaEngine
from specdec.engines.wire import EngineBatch, EngineResult
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState
from specdec.text.request import GenerationRequest
from specdec.text.tokenizer import load_tokenizer

NUM_SLOTS = 4
MAX_CONTEXT = 256
MAX_TOKENS = 24


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


DRAFT_K4 = dict(proposers=("draft_model",), num_draft_tokens=4, fixed_num_draft_tokens=True)
LOOKUP_K8 = dict(proposers=("ngram",), num_draft_tokens=8, fixed_num_draft_tokens=True)
ADAPTIVE: dict = {}  # the server's choice: adaptive k, both proposers
# The top-k of sampled rows: a small support, so a token drawn from the wrong distribution
# (another row's, another position's) falls outside it.
SAMPLED = dict(temperature=1.0, top_k=3)
TOP_K = 3

# (prompt, how it speculates, how it decodes). The first four start together in the four
# slots; the others join after three steps, as rows leave.
REQUESTS = [
    (chat("What is 17 times 23?"), DRAFT_K4, {}),  # short: ends mid-batch
    (chat("Is Paris the capital of France? Answer yes or no."), LOOKUP_K8, SAMPLED),
    (  # copies its prompt: prompt lookup's proposals are accepted
        chat("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."),
        LOOKUP_K8,
        {},
    ),
    (chat("Name three rivers in Europe and one fact about each."), ADAPTIVE, SAMPLED),
    ("def fibonacci(n):\n", DRAFT_K4, {}),  # runs to max_tokens
    (chat('Convert to YAML: {"name": "web", "port": 8080}'), DRAFT_K4, SAMPLED),
    (chat("What colour is the sky on a clear day? One word."), ADAPTIVE, {}),
]
CANCELLED = 3  # cancelled while it runs
TWINS = 5  # asks for two return sequences: the prompt's cache is copied
# bfloat16 has no instructions of its own on most CPUs (4x slower here): it runs the first
# six requests, which have every kind of row above.
NUM_REQUESTS = {torch.float32: len(REQUESTS), torch.bfloat16: 6}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> torch.dtype:
    return getattr(torch, request.param)


@pytest.fixture(scope="module")
def models(dtype, target_dir):
    tokenizer = load_tokenizer(str(target_dir))
    target = LlamaEngine.from_checkpoint(target_dir, NUM_SLOTS, MAX_CONTEXT, dtype=dtype)
    draft = LlamaEngine.from_checkpoint(DRAFT, NUM_SLOTS, MAX_CONTEXT, dtype=dtype)
    return tokenizer, target, draft


class ByteCountingEngines(LocalEngines):
    """The real engines, recording for every call (role, rows, k, bytes returned)."""

    def __init__(self, draft_engine: LlamaEngine, target_engine: LlamaEngine) -> None:
        super().__init__(draft_engine, target_engine)
        self.calls: list[tuple[str, int, int, int]] = []

    def draft(self, batch: EngineBatch) -> EngineResult:
        result = super().draft(batch)
        self.calls.append(("draft", len(batch.slot_ids), int(batch.num_steps.max()), result.nbytes))
        return result

    def target(self, batch: EngineBatch) -> EngineResult:
        result = super().target(batch)
        k = int(batch.num_steps.max()) - 1  # it scores k + 1 positions
        self.calls.append(("target", len(batch.slot_ids), k, result.nbytes))
        return result


def make_scheduler(models) -> SpeculativeScheduler:
    tokenizer, target, draft = models
    config = SchedulerConfig(
        NUM_SLOTS, MAX_CONTEXT, max_draft_tokens=8, default_draft_tokens=None, max_queue=64
    )
    return SpeculativeScheduler(ByteCountingEngines(draft, target), config, tokenizer.decode)


def make_request(models, index: int, **kw) -> GenerationRequest:
    tokenizer = models[0]
    prompt, speculation, decoding = REQUESTS[index]
    ids = tokenizer.encode(prompt)
    kw = {"end_id": tokenizer.eos_token_id, **speculation, **decoding, "seed": index, **kw}
    return GenerationRequest(prompt=None, prompt_ids=ids, max_tokens=MAX_TOKENS, **kw)


def run(scheduler, first: list, later: list = (), cancel: int | None = None):
    """Submits `first`, steps three times, submits `later` (they wait for slots and join
    as others leave), cancels request `cancel` of `first` and runs to the end. Returns the
    sequences in submission order."""
    groups = [scheduler.submit_all([r]) for r in first]
    for _ in range(3):
        scheduler.step()
    groups += [scheduler.submit_all([r]) for r in later]
    if cancel is not None:
        for sequence in groups[cancel]:
            assert sequence.slot >= 0 and not sequence.finished  # cancelled while it runs
            scheduler.cancel(sequence)
    sequences = [s for group in groups for s in group]
    for _ in range(2_000):
        if not scheduler.has_work:
            return sequences
        scheduler.step()
    raise AssertionError("the loop did not finish")


def output(sequence: SequenceState) -> list[int]:
    return sequence.token_ids[len(sequence.request.prompt_ids) :]


def ended(sequence: SequenceState) -> bool:
    return sequence.finish_reason == "end"


def check_greedy(target: LlamaEngine, sequence: SequenceState, dtype: torch.dtype) -> None:
    """Every position against the target decoding one token per call (and the end: an
    end token where it decodes one, none where it does not)."""
    divergences = token_divergences(
        target,
        list(sequence.request.prompt_ids),
        output(sequence),
        sequence.request.end_id,
        ended(sequence),
    )
    if dtype == torch.float32:
        assert divergences == [], divergences  # float32 is exact
    else:
        assert all(d.near_tie(TIE_MARGIN) for d in divergences), divergences


def check_in_support(target: LlamaEngine, sequence: SequenceState, margin: float) -> None:
    """Each sampled token is among the target's top TOP_K at its prefix (within `margin`
    of the k-th logit, for rounding), the end token too where the row ended on it."""
    prompt = list(sequence.request.prompt_ids)
    tokens = output(sequence) + ([sequence.request.end_id] if ended(sequence) else [])
    assert tokens, "nothing sampled"
    fed = prompt + tokens[:-1]
    logits = target.forward(torch.tensor(fed), [len(fed)], [0], [0], [len(tokens)]).float()
    kth = logits.topk(TOP_K, dim=-1).values[:, -1]
    chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    outside = torch.nonzero(chosen < kth - margin).flatten().tolist()
    assert outside == [], f"tokens outside the target's top {TOP_K} at positions {outside}"


def check_only_tokens_returned(engines: ByteCountingEngines) -> None:
    """Every engine call returned at most rows x (k + 1) x 16 bytes: token ids and
    log-probabilities, no logits or distributions."""
    assert {role for role, *_ in engines.calls} == {"draft", "target"}
    over = [call for call in engines.calls if call[3] > call[1] * (call[2] + 1) * 16]
    assert over == [], over


def check_finish(sequence: SequenceState, cancelled: bool = False) -> None:
    if cancelled:
        assert sequence.finish_reason == "cancelled"
        return
    assert sequence.finish_reason in ("end", "length"), sequence.finish_reason
    if sequence.finish_reason == "length":
        assert len(output(sequence)) == MAX_TOKENS


def test_greedy_and_sampled_rows_in_one_batch(models, dtype):
    """7 requests (bfloat16: 6) over 4 slots, greedy and sampled, drafted by the model
    (k = 4), by prompt lookup (k = 8) and adaptively; the later ones join after the first
    steps, one is cancelled mid-way, one has two sequences. Greedy rows decode as the target
    one token per call does (float32: exactly), sampled rows stay in the target's support
    at every position."""
    margin = 1e-3 if dtype == torch.float32 else TIE_MARGIN
    scheduler = make_scheduler(models)
    requests = [make_request(models, i) for i in range(NUM_REQUESTS[dtype])]
    requests[TWINS].num_return_sequences = 2
    for index in (0, 1):  # a greedy and a sampled row return log-probabilities
        requests[index].return_log_probs = True
    sequences = run(scheduler, requests[:4], requests[4:], cancel=CANCELLED)
    check_only_tokens_returned(scheduler.engines.engines)
    target = models[1]
    for sequence in sequences:
        check_finish(sequence, cancelled=sequence.request is requests[CANCELLED])
        if sequence.request.greedy:
            check_greedy(target, sequence, dtype)
        else:
            check_in_support(target, sequence, margin)
    greedy = [s for s in sequences if s.request.greedy]
    assert any(ended(s) for s in greedy) and any(not ended(s) for s in greedy)
    drafted = sum(s.stats.num_draft_tokens for s in sequences)
    accepted = sum(s.stats.num_accepted_draft_tokens for s in sequences)
    assert 0 < accepted < drafted  # speculation ran, and was not always right
    looked_up = [s for s in greedy if s.request.proposers == ("ngram",)]
    assert sum(s.stats.num_accepted_draft_tokens for s in looked_up) > 0
    sampled = [s for s in sequences if not s.request.greedy]
    assert sum(s.stats.num_accepted_draft_tokens for s in sampled) > 0
    twins = [s for s in sequences if s.request is requests[TWINS]]
    assert len(twins) == 2 and output(twins[0]) != output(twins[1])


def test_a_draft_equal_to_the_target_is_always_accepted(target_dir):
    """float32, the target as its own draft: greedy proposals are the target's own tokens,
    and so are sampled ones (the draft draws with the target's noise), so every one is
    accepted (a near-tie could cost one). A draft whose cache bookkeeping is off by a
    position proposes from the wrong context and is rejected."""
    tokenizer = load_tokenizer(str(target_dir))
    target = LlamaEngine.from_checkpoint(target_dir, NUM_SLOTS, MAX_CONTEXT)
    self_draft = LlamaEngine.from_checkpoint(target_dir, NUM_SLOTS, MAX_CONTEXT)
    models = (tokenizer, target, self_draft)
    scheduler = make_scheduler(models)
    requests = [make_request(models, i, **DRAFT_K4) for i in (0, 4, 5)]  # 5 is sampled
    sequences = run(scheduler, requests)
    assert not sequences[2].request.greedy
    for sequence in sequences:
        check_finish(sequence)
        if sequence.request.greedy:
            check_greedy(target, sequence, torch.float32)
        else:
            check_in_support(target, sequence, 1e-3)
    drafted = sum(s.stats.num_draft_tokens for s in sequences)
    accepted = sum(s.stats.num_accepted_draft_tokens for s in sequences)
    assert drafted > 0 and accepted >= drafted - 1, (accepted, drafted)


def test_seeded_sampling_does_not_depend_on_the_drafter(models, dtype):
    """One seeded sampled request (top-k 3) three times in one batch: speculation off, the
    draft model at k = 4, prompt lookup at k = 8. float32: the same tokens. bfloat16: the same up to
    the first position where plain decoding's top two perturbed scores (logits / T + the
    row's noise) lie within the tie margin (scaled by 1 / T)."""
    tokenizer, target, _ = models
    scheduler = make_scheduler(models)
    drafters = [dict(num_draft_tokens=0), DRAFT_K4, LOOKUP_K8]
    # The prompt that asks for a copy: both proposers have tokens accepted.
    requests = [make_request(models, 2, seed=77, **SAMPLED, **d) for d in drafters]
    sequences = run(scheduler, requests)
    plain, *drafted = [output(s) for s in sequences]
    assert sum(s.stats.num_accepted_draft_tokens for s in sequences[1:]) > 0
    for tokens in drafted:
        if dtype == torch.float32:
            assert tokens == plain
            continue
        pairs = zip(tokens, plain, strict=False)
        # The first position where they part: a token, or where one ended and not the other.
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        if first is None and len(tokens) == len(plain):
            continue
        first = min(len(tokens), len(plain)) if first is None else first
        gap = perturbed_gap(target, sequences[0], first)
        assert gap < TIE_MARGIN / SAMPLED["temperature"], (first, gap)


def perturbed_gap(target: LlamaEngine, sequence: SequenceState, position: int) -> float:
    """The top-2 gap of plain decoding's perturbed scores at output `position`."""
    request = sequence.request
    fed = list(request.prompt_ids) + output(sequence)[:position]
    logits = target.forward(torch.tensor(fed), [len(fed)], [0], [0], [1]).float()
    kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
    scores = logits.masked_fill(logits < kth, float("-inf")) / SAMPLED["temperature"]
    values = perturbed_scores(scores, torch.tensor([sequence.seed]), torch.tensor([len(fed)]))
    top2 = values.topk(2, dim=-1).values[0]
    return float(top2[0] - top2[1])
