"""The torch engine against Hugging Face transformers, and the engine calls' sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.engines.calls import run_draft, run_target
from specdec.engines.engine import check_rows
from specdec.engines.llama import LlamaEngine
from specdec.engines.sampling import RowSampling, probs_from_logits
from specdec.engines.wire import EngineBatch, hindsight_lengths


@pytest.fixture(scope="module")
def engine(target_dir):
    return LlamaEngine.from_checkpoint(target_dir, num_slots=4, max_length=128)


def test_packed_batch_logits_match_hf(engine, hf_target):
    tokenizer, model = hf_target
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time, in a"]
    ids = [tokenizer(p).input_ids for p in prompts]
    split = [len(x) - 3 for x in ids]
    # Prefill the heads of three rows in one packed call, then their tails (3 tokens each).
    engine.forward(
        torch.tensor([t for x, s in zip(ids, split, strict=True) for t in x[:s]]),
        split,
        [0, 1, 2],
        [0, 0, 0],
        [1, 1, 1],
    )
    logits = engine.forward(
        torch.tensor([t for x, s in zip(ids, split, strict=True) for t in x[s:]]),
        [3, 3, 3],
        [0, 1, 2],
        split,
        [3, 3, 3],
    )
    for row, x in enumerate(ids):
        with torch.inference_mode():
            reference = model(torch.tensor([x])).logits[0, -3:]
        assert torch.allclose(logits[3 * row : 3 * row + 3], reference, atol=1e-3)


def test_rows_of_mixed_widths_in_scattered_slots_match_hf(target_dir, hf_target):
    # Each width attends in a call of its own: decoding rows in adjacent slots, packed out
    # of slot order, read the slot range (A, B; their queries are gathered into slot order
    # and their outputs scattered back); rows that fill less of their range read a gathered
    # copy of their slots (C, D: 2 of 3); rows that fill most of a range with a gap read it
    # padded, the gap masked (F, G, H, I); and a row alone at its width attends by itself (E).
    # Every path must give HF's logits.
    tokenizer, model = hf_target
    engine = LlamaEngine.from_checkpoint(target_dir, num_slots=12, max_length=128)
    prompts = {  # slot -> (prompt, new tokens in the call), in packed order
        1: ("def add(a, b):", 1),
        0: ("The capital of France is", 1),
        2: ("Once upon a time, in a", 3),
        4: ("Water boils at a temperature of", 3),
        5: ("The quick brown fox jumps over", 4),
        8: ("import numpy as np", 2),
        6: ("Dear Sir or Madam, I am writing", 2),
        10: ("SELECT name FROM users WHERE", 2),
        7: ("The weather today is sunny and", 2),
    }
    ids = {slot: tokenizer(text).input_ids for slot, (text, _) in prompts.items()}
    widths = {slot: width for slot, (_, width) in prompts.items()}
    slots = list(prompts)
    heads = [ids[s][: -widths[s]] for s in slots]
    engine.forward(
        torch.tensor([t for head in heads for t in head]),
        [len(head) for head in heads],
        slots,
        [0] * len(slots),
        [1] * len(slots),
    )
    lengths, cached = [widths[s] for s in slots], [len(head) for head in heads]
    starts = [0, *np.cumsum(lengths).tolist()]
    plan = engine._plan_attention(lengths, slots, cached, starts)
    reads = {b.width: (b.span, isinstance(b.slots, slice)) for b in plan.batched}
    # (slots read, through a view): A, B a range of 2; C, D their 2 slots gathered; F-I 4 of 5
    assert reads == {1: (2, True), 3: (2, False), 2: (5, True)}
    assert [slot for slot, *_ in plan.looped] == [5]  # E
    logits = engine.forward(
        torch.tensor([t for s in slots for t in ids[s][-widths[s] :]]),
        lengths,
        slots,
        cached,
        lengths,
    )
    start = 0
    for s in slots:
        with torch.inference_mode():
            reference = model(torch.tensor([ids[s]])).logits[0, -widths[s] :]
        assert torch.allclose(logits[start : start + widths[s]], reference, atol=1e-3), s
        start += widths[s]


def batch(**overrides) -> EngineBatch:
    fields = dict(
        input_ids=np.array([1, 2, 3, 4, 5], dtype=np.int64),
        input_lengths=np.array([5], dtype=np.int32),
        slot_ids=np.array([3], dtype=np.int32),
        cache_lengths=np.array([0], dtype=np.int32),
        num_steps=np.array([4], dtype=np.int32),
        temperature=np.array([0.0], dtype=np.float32),
        top_k=np.array([0], dtype=np.int32),
        top_p=np.array([1.0], dtype=np.float32),
        end_ids=np.array([-1], dtype=np.int32),
        min_tokens_left=np.array([0], dtype=np.int32),
        seeds=np.array([1], dtype=np.int64),
    )
    fields.update(overrides)
    return EngineBatch(**fields)


def test_greedy_draft_equals_greedy_target_steps(engine):
    proposed = run_draft(engine, batch()).token_ids[0].tolist()
    scored = run_target(
        engine,
        batch(
            input_ids=np.array([1, 2, 3, 4, 5] + proposed[:3]),
            input_lengths=np.array([8], dtype=np.int32),
        ),
    )
    # The model proposing for itself agrees with its own verification at every position.
    assert scored.token_ids[0].tolist() == proposed


def test_a_sampled_model_proposing_for_itself_is_always_accepted(engine):
    """Sampled, the draft draws with the target's noise (seed, position): the same model
    proposing for itself proposes exactly the target's own tokens, which lie in the top 40;
    another seed draws other tokens. Only token ids come back."""
    sampled = dict(
        temperature=np.array([0.9], dtype=np.float32), top_k=np.array([40], dtype=np.int32)
    )
    first = run_draft(engine, batch(**sampled))
    assert first.token_ids.tolist() == run_draft(engine, batch(**sampled)).token_ids.tolist()
    other = run_draft(engine, batch(seeds=np.array([2], dtype=np.int64), **sampled))
    assert other.token_ids.tolist() != first.token_ids.tolist()
    proposed = first.token_ids[0].tolist()
    scored = run_target(
        engine,
        batch(
            input_ids=np.array([1, 2, 3, 4, 5] + proposed[:3]),
            input_lengths=np.array([8], dtype=np.int32),
            return_log_probs=np.array([True]),
            **sampled,
        ),
    )
    assert scored.token_ids[0].tolist() == proposed
    assert set(first.to_arrays()) == {"token_ids", "hindsight_hits", "log_probs"}
    # Each token's log-probability under the top-40 distribution it was drawn from.
    logits = engine.forward(
        torch.tensor([1, 2, 3, 4, 5] + proposed[:3]), [8], [3], [0], [4]
    )  # (4, V)
    top = logits.float() / 0.9
    kth = top.topk(40, dim=-1).values[:, -1:]
    expected = torch.log_softmax(top.masked_fill(top < kth, float("-inf")), dim=-1)
    expected = expected.gather(-1, torch.tensor(proposed)[:, None]).squeeze(-1)
    assert np.allclose(scored.log_probs[0], expected.numpy(), atol=1e-4)
    assert (expected > float("-inf")).all()


def test_end_token_blocked_before_min_tokens(engine):
    logits = torch.zeros(2, 8)
    logits[:, 2] = 10.0
    sampling = RowSampling(
        temperature=torch.tensor([1.0, 1.0]),
        top_k=torch.tensor([0, 0]),
        top_p=torch.tensor([1.0, 1.0]),
        end_id=torch.tensor([2, 2]),
        block_end=torch.tensor([True, False]),
    )
    probs = probs_from_logits(logits, sampling)
    assert probs[0, 2] == 0 and probs[1, 2] > 0.99


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampling = RowSampling(
        torch.tensor([1.0]),
        torch.tensor([0]),
        torch.tensor([0.8]),
        torch.tensor([-1]),
        torch.tensor([False]),
    )
    probs = probs_from_logits(logits, sampling)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_unwritten_cache_memory_never_reaches_the_logits(target_dir, monkeypatch):
    """Batched attention reads (and masks) positions nothing has written yet: slots in the
    call's slot range but not in the call, positions past a short row. If the cache started
    as reused allocator memory holding NaN, a masked NaN would still poison the softmax
    (this failed in CI). Allocation is made to hand back NaN; logits must stay finite."""
    real_empty = torch.empty

    def used_memory(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", used_memory)
    engine = LlamaEngine.from_checkpoint(target_dir, num_slots=4, max_length=64)
    monkeypatch.setattr(torch, "empty", real_empty)
    # Rows in slots 0 and 3 of different lengths: slots 1 and 2 are in the window, unused.
    engine.forward(torch.arange(10, 22), [9, 3], [0, 3], [0, 0], [1, 1])
    logits = engine.forward(torch.tensor([5, 6]), [1, 1], [0, 3], [9, 3], [1, 1])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("input_lengths", "cache_lengths", "num_logits", "fits"),
    [
        ([3], [0], [1], True),
        ([3, 2], [5, 6], [3, 2], True),  # both end at max_length
        ([3, 3], [0, 6], [1, 1], False),  # the second row ends past it
        ([0], [0], [0], False),  # no new tokens
        ([3], [0], [0], False),  # no logits
        ([3], [0], [4], False),  # logits of a position the row does not add
    ],
)
def test_a_row_that_does_not_fit_is_refused(input_lengths, cache_lengths, num_logits, fits):
    """Every engine checks its rows with check_rows (max_length 8 here)."""
    if fits:
        check_rows(input_lengths, cache_lengths, num_logits, 8)
        return
    with pytest.raises(ValueError, match="does not fit max_length 8"):
        check_rows(input_lengths, cache_lengths, num_logits, 8)


def test_the_torch_engine_refuses_a_row_past_max_length(engine):
    with pytest.raises(ValueError, match=r"row of 3 new tokens after 126 cached positions"):
        engine.forward(torch.arange(3), [3], [0], [126], [1])


def test_draft_guesses_its_fed_tokens_and_may_propose_none(engine):
    # Row 0 catches up on 12 tokens and proposes nothing (a probe); row 1, sampled, proposes
    # two.
    tokens = [5, 9, 2, 7, 7, 1]  # then the model's own greedy tokens: guesses it gets right
    for _ in range(6):
        logits = engine.forward(torch.tensor(tokens), [len(tokens)], [2], [0], [1])
        tokens.append(int(logits.argmax(-1)[0]))
    result = run_draft(
        engine,
        batch(
            input_ids=np.array(tokens + [1, 2, 3, 4, 5], dtype=np.int64),
            input_lengths=np.array([12, 5], dtype=np.int32),
            slot_ids=np.array([0, 1], dtype=np.int32),
            cache_lengths=np.array([0, 0], dtype=np.int32),
            num_steps=np.array([0, 2], dtype=np.int32),
            temperature=np.array([0.0, 0.9], dtype=np.float32),
            top_k=np.array([0, 0], dtype=np.int32),
            top_p=np.array([1.0, 1.0], dtype=np.float32),
            end_ids=np.array([-1, -1], dtype=np.int32),
            min_tokens_left=np.array([0, 0], dtype=np.int32),
            seeds=np.array([1, 2], dtype=np.int64),
        ),
    )
    reference = engine.forward(torch.tensor(tokens), [12], [2], [0], [12]).argmax(-1)
    # The guesses of tokens 1..11, each against the token fed there.
    expected = [
        guess == fed for guess, fed in zip(reference[:11].tolist(), tokens[1:], strict=True)
    ]
    assert result.hindsight(0, 11) == expected
    assert any(expected) and not all(expected)  # otherwise the test shows little
    assert result.hindsight(1, 0) == []  # sampled: its tokens are draws, nothing to guess
    assert result.token_ids[0].tolist() == [-1, -1]
    assert (result.token_ids[1] >= 0).all()


def test_only_a_greedy_catch_up_is_guessed():
    # A drafting row is fed 1 or 2 tokens; a sampled row's tokens are draws.
    lengths = np.array([40, 12, 2, 1, 5], dtype=np.int32)
    temperature = np.array([0.0, 0.0, 0.0, 0.0, 0.9], dtype=np.float32)
    assert hindsight_lengths(lengths, temperature).tolist() == [32, 11, 0, 0, 0]
