"""The suffix proposer (specdec/loop/proposers/suffix.py) and its store
(specdec/loop/suffix_store.py): what a walk proposes, the bound in bytes, eviction, salts,
and the loop's output with it (the fakes' target: tests/fakes.py)."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

import fakes
from fakes import FakeEngines, fake_decode
from specdec.loop.config import SchedulerConfig
from specdec.loop.proposers.base import Candidate
from specdec.loop.proposers.suffix import SHARED_KEY, SuffixProposer
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState
from specdec.loop.suffix_store import SuffixIndex, SuffixStore
from specdec.paths import PROJECT_ROOT
from specdec.text.request import GenerationRequest

sys.path.insert(0, str(PROJECT_ROOT / "loadtest"))
from suffix_cost import run as measure_cost  # noqa: E402


def indexed(text: list[int], depth: int) -> SuffixIndex:
    index = SuffixIndex(depth)
    index.add_from(text, 1)
    return index


@pytest.mark.parametrize(
    ("text", "tail", "max_tokens", "tokens", "probabilities"),
    [
        # (7, 1) was followed by 2 twice, 3 once: 2 / (3 + 1/2); then (1, 2) by 7 once: 1 / 1.5
        ([7, 1, 2, 7, 1, 3, 7, 1, 2], [5, 7, 1], 2, [2, 7], [4 / 7, 4 / 7 * 2 / 3]),
        # ...and on, (2, 7) -> 1, (7, 1) -> 2, until the product falls below 0.1
        (
            [7, 1, 2, 7, 1, 3, 7, 1, 2],
            [5, 7, 1],
            8,
            [2, 7, 1, 2],
            [4 / 7, 8 / 21, 16 / 63, 64 / 441],
        ),
        # a context seen four times the same way is surer than one seen once
        ([4, 5, 6] * 4, [9, 4, 5], 2, [6, 4], [8 / 9, 8 / 9 * 6 / 7]),
        ([4, 5, 6], [9, 4, 5], 2, [6], [2 / 3]),
        # a longer context is surer: seen once after 2 tokens, 2/3; after 1 token, 1/2
        ([4, 5, 6], [9, 9, 5], 2, [6], [1 / 2]),
        ([1, 2, 3], [8, 9], 4, [], []),  # no context of the tail was seen
    ],
)
def test_a_walk_follows_the_most_frequent_continuation_while_it_is_sure(
    text, tail, max_tokens, tokens, probabilities
):
    walk = indexed(text, depth=2).walk(tail, max_tokens, min_probability=0.1)
    assert walk.token_ids == tokens
    assert walk.probabilities == pytest.approx(probabilities)


def test_removing_what_was_added_leaves_the_index_as_if_it_never_was():
    rng = random.Random(0)
    first = [rng.randrange(20) for _ in range(300)]
    second = [rng.randrange(20) for _ in range(300)]
    both = indexed(first, 4)
    for end in range(1, len(second)):
        both.add(second, end)
    for end in range(1, len(first)):
        both.remove(first, end)
    alone = indexed(second, 4)
    assert set(both.table) == set(alone.table)
    for context, followers in alone.table.items():
        kept = both.table[context]
        assert (kept.total, kept.best_count) == (followers.total, followers.best_count)
    assert both.num_followers == alone.num_followers


def template_text(rng: random.Random, num_tokens: int) -> list[int]:
    """Text of repeated phrases and fresh tokens, as answers of one template look."""
    phrases = [[rng.randrange(49152) for _ in range(6)] for _ in range(40)]
    text: list[int] = []
    while len(text) < num_tokens:
        text += rng.choice(phrases) if rng.random() < 0.5 else [rng.randrange(49152)]
    return text[:num_tokens]


def test_the_store_holds_its_bound_in_bytes_over_a_long_run_and_evicts_the_oldest():
    rng = random.Random(1)
    store = SuffixStore(max_bytes=2_000_000)
    documents = []
    for i in range(300):  # ~60,000 tokens: about 40 times the bound
        document = store.open(f"tenant-{i % 3}", [1, 2, 3])
        for _ in range(10):  # fed as a row's steps commit
            document = store.extend(document, template_text(rng, 20))
        documents.append(document)
        assert store.counts.num_bytes <= store.max_bytes or len(store.documents) == 1
    counts = store.counts
    assert counts.num_evicted_documents > 200 and counts.num_evicted_tokens > 40_000
    assert counts.num_documents == len(store.documents) < 100
    # The oldest went first: what is left is the newest documents, in order.
    assert list(store.documents) == documents[-len(store.documents) :]
    assert all(d.evicted for d in documents[: -len(store.documents)])
    # Evicting takes every count back out: the tables are what the kept text alone makes.
    kept = {salt: SuffixIndex(store.depth) for salt in store.indexes}
    for document in store.documents:
        for end in range(document.first_counted, len(document.token_ids)):
            kept[document.salt].add(document.token_ids, end)
    assert {s: len(i.table) for s, i in kept.items()} == {
        s: len(i.table) for s, i in store.indexes.items()
    }


@pytest.mark.parametrize("vocabulary", [30, 2000, 49152])
def test_the_bytes_counted_are_an_upper_bound_of_the_memory_the_tables_take(vocabulary):
    """BYTES_PER_* against tracemalloc: few contexts with many followers, and many contexts
    with one each; counted never below what Python allocated, and not far above it."""
    rng = random.Random(vocabulary)
    texts = [[rng.randrange(vocabulary) for _ in range(200)] for _ in range(150)]
    tracemalloc.start()
    try:
        store = SuffixStore(max_bytes=10**12)
        before = tracemalloc.get_traced_memory()[0]
        for text in texts:
            store.extend(store.open("", text[:8]), text[8:])
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert allocated <= store.counts.num_bytes <= 2.0 * allocated


def config(**kw) -> SchedulerConfig:
    kw.setdefault("default_draft_tokens", None)
    return SchedulerConfig(num_slots=8, max_context=256, max_draft_tokens=6, **kw)


def candidate(prompt: list[int], salt: str = "") -> Candidate:
    request = GenerationRequest(None, prompt, 50, cache_salt=salt)
    sequence = SequenceState(request, detokenizer=None, seed=0, token_ids=list(prompt))  # type: ignore[arg-type]
    sequence.id = sum(prompt) + len(salt)
    return Candidate(sequence, max_k=6)


def test_a_row_proposes_only_from_its_own_salts_text():
    proposer = SuffixProposer(config(), engines=None)  # type: ignore[arg-type]
    earlier = candidate([40, 41, 42, 1, 2, 3, 4, 5, 6, 7, 8], salt="a")
    earlier.sequence.token_ids += [9, 10, 11, 12]  # its output, committed
    proposer.committed([earlier.sequence])
    same, other = candidate([30, 31, 6, 7, 8], salt="a"), candidate([30, 31, 6, 7, 8], salt="b")
    offer = proposer.offer(same)
    assert offer.num_tokens > 0 and offer.key is not None and offer.key >= SHARED_KEY
    assert proposer.walks[same.sequence.id].token_ids[:2] == [9, 10]
    assert proposer.offer(other).num_tokens == 0  # its own text has no match either
    assert proposer.store.walk("b", [6, 7, 8], 6, 0.1).token_ids == []


def run(requests: list[GenerationRequest], proposers: tuple[str, ...]) -> list[list[int]]:
    scheduler = SpeculativeScheduler(FakeEngines(8), config(proposer_names=proposers), fake_decode)
    sequences = [scheduler.submit(r) for r in requests]
    while scheduler.has_work:
        scheduler.step()
    return [s.token_ids[len(s.request.prompt_ids) :] for s in sequences]


def test_greedy_and_seeded_output_does_not_depend_on_the_store(monkeypatch):
    """A target that copies (so the store has something to propose): the same text with
    the suffix proposer on and off, at a fixed k and adaptive, greedy and seeded, for rows
    that run one after another (the store full of the first ones' text) and in a batch."""
    monkeypatch.setattr(fakes, "oracle_next", fakes.copying_oracle)
    prompts = [[(3 * i + j) % 11 + 1 for j in range(9)] for i in range(6)]

    def requests(**kw) -> list[GenerationRequest]:
        return [
            GenerationRequest(None, p, 40, end_id=-1, seed=i, **kw) for i, p in enumerate(prompts)
        ]

    fixed = dict(num_draft_tokens=5, fixed_num_draft_tokens=True, proposers=("suffix",))
    for sampling in ({}, {"temperature": 0.8}):
        plain = run(requests(num_draft_tokens=0, **sampling), ("draft_model",))
        for speculation in (fixed, {}):
            batched = run(requests(**speculation, **sampling), ("suffix", "ngram"))
            assert batched == plain
            one_by_one = [run([r], ("suffix",))[0] for r in requests(**speculation, **sampling)]
            assert one_by_one == plain


def passes_one_after_another(salts: list[str]) -> list[int]:
    """Target passes of requests with the same last prompt tokens, run one after another
    with the suffix proposer at k = 5, each under its salt."""
    server = config(proposer_names=("suffix",))
    scheduler = SpeculativeScheduler(FakeEngines(8), server, fake_decode)
    fixed = dict(num_draft_tokens=5, fixed_num_draft_tokens=True)
    passes = []
    for i, salt in enumerate(salts):
        prompt = [50 + i, 1, 2, 3, 4, 5, 6, 7]
        request = GenerationRequest(None, prompt, 30, end_id=-1, cache_salt=salt, **fixed)
        sequence = scheduler.submit(request)
        while scheduler.has_work:
            scheduler.step()
        assert sequence.token_ids[8:] == fakes.oracle_continuation(prompt, 30)
        passes.append(sequence.stats.num_target_passes)
    return passes


def test_the_store_pays_where_answers_repeat_other_requests_text(monkeypatch):
    """Answers that repeat an earlier request's (the copying target): under one salt the
    later requests propose the earlier answers' continuations from the first token on and
    need fewer passes; under a salt each, only their own text, as the first one did."""
    monkeypatch.setattr(fakes, "oracle_next", fakes.copying_oracle)
    shared = passes_one_after_another(["", "", "", ""])
    apart = passes_one_after_another(["a", "b", "c", "d"])
    assert apart == [apart[0]] * 4
    assert shared[0] == apart[0] and all(p < apart[0] for p in shared[1:]), (shared, apart)


def test_the_cost_script_times_proposals_and_fed_tokens_at_its_rows():
    """loadtest/suffix_cost.py on a few rows: the figures it writes are there and sane (its
    timings are measured, never asserted here)."""
    report = measure_cost(num_rows=4, num_steps=10, max_k=4)
    assert report["rows"] == 4 and report["store_tokens"] > 10_000
    assert 0 < report["store_bytes"] <= 128 << 20
    for name in ("offer_us_per_row_median", "feed_us_per_token_median"):
        assert report[name] > 0
