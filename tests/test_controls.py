"""Logit controls under speculation (specdec/engines/controls.py): penalties, min_p, biases and
bad words stay exact at every verified position.

- Engine calls over a scripted vocabulary: each position of a verify and each draft step is
  processed with exactly the tokens before it (a reference written here, loop by loop).
- Through the loop: sampled rows with penalties that bite inside the verify window follow the
  processed target's law (chi-square over every emitted position, the bonus included); seeded
  rows give the same tokens whoever drafts.
- The real engines in process: greedy output with each control equals transformers' generate
  with the same processing (float32), at k = 0, 1, 4 and 8 and with each proposer, alone and
  beside rows without controls; bfloat16 parts from plain decoding only at near-ties.
tests/mutations/run.py plants the bugs these tests must catch (a penalty that misses the
proposals before its position, one that counts the position's own token).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from build.greedy_parity import TIE_MARGIN
from conftest import DRAFT
from specdec.engines.calls import LocalEngines, run_draft, run_target
from specdec.engines.llama import LlamaEngine
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import SequenceState, engine_batch
from specdec.text.request import GenerationRequest
from specdec.text.tokenizer import load_tokenizer
from stats import chi_square, critical_0_001

VOCAB = 6


# -- a scripted engine: logits that depend on the whole prefix ------------------------------
def scripted_logits(prefix: list[int], sharpness: float) -> torch.Tensor:
    """(VOCAB,) float32: favours repeating the last token (so penalties bite), with a
    position-dependent tilt so no two positions are alike."""
    logits = torch.tensor([0.3 * ((len(prefix) * (t + 2)) % 5) for t in range(VOCAB)])
    logits[prefix[-1] % VOCAB] += 2.0 * sharpness
    logits[(prefix[-1] + 1) % VOCAB] += 1.0
    logits[sum(prefix) % VOCAB] -= 0.7
    return logits.float()


class ScriptedEngine:
    """An Engine (specdec/engines/engine.py) over VOCAB tokens whose logits at each position
    are scripted_logits of the slot's tokens up to it: it keeps a real cache of tokens."""

    def __init__(self, num_slots: int, max_length: int, sharpness: float) -> None:
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.num_slots, self.max_length, self.sharpness = num_slots, max_length, sharpness
        self.slots: dict[int, list[int]] = {s: [] for s in range(num_slots)}

    def forward(self, input_ids, input_lengths, slot_ids, cache_lengths, num_logits):
        rows, start = [], 0
        for length, slot, cached, wanted in zip(
            input_lengths, slot_ids, cache_lengths, num_logits, strict=True
        ):
            held = self.slots[slot]
            assert cached <= len(held)
            del held[cached:]
            held.extend(int(t) for t in input_ids[start : start + length])
            start += length
            for end in range(len(held) - wanted + 1, len(held) + 1):
                rows.append(scripted_logits(held[:end], self.sharpness))
        return torch.stack(rows)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.slots[dst] = self.slots[src][:length]


# -- the reference: the processing written out, one token at a time --------------------------
def reference_logits(
    logits: torch.Tensor, before: list[int], request: GenerationRequest
) -> torch.Tensor:
    """The controls of `request` on the logits that choose the token after `before` (the
    prompt and the output so far), in float64."""
    processed = logits.double().clone()
    for token, value in request.logit_bias.items():
        processed[token] += value
    for word in request.bad_words_ids:
        if len(before) >= len(word) - 1 and before[len(before) - len(word) + 1 :] == word[:-1]:
            processed[word[-1]] = -math.inf
    if request.repetition_penalty != 1.0:
        for token in set(before):
            value = processed[token]
            penalty = request.repetition_penalty
            processed[token] = value / penalty if value > 0 else value * penalty
    counted = before[min(request.prompt_ignore_length, len(request.prompt_ids)) :]
    for token in set(counted):
        processed[token] -= request.presence_penalty
    for token in counted:
        processed[token] -= request.frequency_penalty
    return processed


def reference_probs(processed: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
    """The sampled distribution from processed logits: temperature, top-k, top-p, min_p."""
    probs = torch.softmax(processed / request.temperature, dim=-1)
    if request.min_p > 0:
        probs = torch.where(probs >= request.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


CONTROLS = {
    "repetition": dict(repetition_penalty=1.8),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.2),
    "frequency-output-only": dict(frequency_penalty=1.2, prompt_ignore_length=2**31 - 1),
    "logit-bias": dict(logit_bias={2: 1.5, 3: -2.0}),
    "bad-words": dict(bad_words_ids=[[4], [1, 1], [2, 3, 2]]),
    "all": dict(
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        logit_bias={0: 0.5},
        bad_words_ids=[[3, 3]],
        min_p=0.05,
    ),
}


def scripted_request(prompt: list[int], max_tokens: int = 4, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=None, prompt_ids=prompt, max_tokens=max_tokens, **kw)


def sequence_of(request: GenerationRequest, output: list[int], slot: int) -> SequenceState:
    tokens = list(request.prompt_ids) + output
    return SequenceState(request, None, seed=7, slot=slot, token_ids=tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_verified_position_counts_exactly_the_tokens_before_it(name):
    """A verify of pending + proposals with repeats in it: the target's token at each
    position is the argmax of the reference processing of the tokens before that position,
    proposals included, the position's own token not. A row without controls rides along."""
    engine = ScriptedEngine(2, 64, sharpness=1.0)
    prompt, output = [1, 2, 1, 5], [1, 1]
    controlled = scripted_request(prompt, **CONTROLS[name])
    plain = scripted_request(prompt)
    proposals = [1, 1, 3, 3, 2]  # repeats: counts change inside the window
    rows = [sequence_of(controlled, output, 0), sequence_of(plain, output, 1)]
    cached = len(prompt) + len(output) - 1
    pending = [rows[0].token_ids[cached:] + proposals, rows[1].token_ids[cached:] + proposals]
    engine.forward(prompt + output[:-1], [cached], [0], [0], [1])  # the slots' caches
    engine.forward(prompt + output[:-1], [cached], [1], [0], [1])
    batch = engine_batch(rows, pending, [cached, cached], [len(proposals) + 1] * 2)
    tokens = run_target(engine, batch).token_ids  # (2, k + 1)
    sequence = prompt + output + proposals
    for j in range(len(proposals) + 1):
        before = sequence[: len(prompt) + len(output) + j]
        logits = scripted_logits(before, 1.0)
        assert tokens[0, j] == int(reference_logits(logits, before, controlled).argmax()), j
        assert tokens[1, j] == int(logits.argmax()), j


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_draft_step_counts_its_own_proposals(name):
    """The draft processes its steps as the target does, its proposals so far included."""
    engine = ScriptedEngine(1, 64, sharpness=1.0)
    prompt = [3, 1, 1]
    request = scripted_request(prompt, **CONTROLS[name])
    row = sequence_of(request, [], 0)
    batch = engine_batch([row], [prompt], [0], [5])
    proposals = run_draft(engine, batch).token_ids[0].tolist()
    sequence = list(prompt)
    for step, token in enumerate(proposals):
        expected = reference_logits(scripted_logits(sequence, 1.0), sequence, request).argmax()
        assert token == int(expected), step
        sequence.append(token)


# -- through the loop ----------------------------------------------------------------------
def scripted_scheduler(num_slots: int = 16, max_queue: int = 10_000) -> SpeculativeScheduler:
    # The draft is sharper than the target: its proposals are often, not always, accepted.
    engines = LocalEngines(
        ScriptedEngine(num_slots, 64, sharpness=1.6), ScriptedEngine(num_slots, 64, sharpness=1.0)
    )
    config = SchedulerConfig(
        num_slots, 64, max_draft_tokens=8, default_draft_tokens=None, max_queue=max_queue
    )
    return SpeculativeScheduler(engines, config, lambda ids: "".join(map(str, ids)))


def run_all(scheduler: SpeculativeScheduler, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not scheduler.has_work:
            return
        scheduler.step()
    raise AssertionError("the loop did not finish")


def processed_law(prompt: list[int], length: int, request: GenerationRequest) -> dict:
    """P(the next `length` tokens) of a sampled row under the reference processing."""
    law = {(): 1.0}
    for _ in range(length):
        law = {
            seq + (t,): p * float(q)
            for seq, p in law.items()
            for t, q in enumerate(
                reference_probs(
                    reference_logits(
                        scripted_logits(prompt + list(seq), 1.0), prompt + list(seq), request
                    ),
                    request,
                )
            )
            if q > 0
        }
    return law


SAMPLED_CONTROLS = dict(
    frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.4, min_p=0.02
)


def test_sampled_rows_with_penalties_follow_the_processed_target():
    """Sampled rows with penalties that bite inside the window (the scripted target favours
    repeating itself), drafted at k = 3, max_tokens 4 (the bonus included), beside greedy rows
    without controls: the law of all 4 tokens is the processed target's. Negative control: the
    same counts against the law without penalties fail."""
    scheduler = scripted_scheduler()
    prompt = [2, 2]
    draft = dict(num_draft_tokens=3, fixed_num_draft_tokens=True, proposers=("draft_model",))
    sampled, greedy = [], []
    for i in range(3_000):
        if i % 4 == 3:
            greedy.append(scheduler.submit(scripted_request(prompt, **draft)))
            continue
        request = scripted_request(prompt, temperature=1.0, seed=i, **draft, **SAMPLED_CONTROLS)
        sampled.append(scheduler.submit(request))
    run_all(scheduler)
    assert sum(s.stats.num_accepted_draft_tokens for s in sampled) > 0
    outputs = [tuple(s.token_ids[2:]) for s in sampled]
    for request in (sampled[0].request, scripted_request(prompt, temperature=1.0)):
        law = processed_law(prompt, 4, request)
        cells = sorted(law)
        counts = torch.tensor([float(outputs.count(cell)) for cell in cells])
        stat, dof = chi_square(counts, torch.tensor([law[c] for c in cells]))
        if request is sampled[0].request:
            assert counts.sum() == len(outputs), "a sequence the processed target never emits"
            assert stat < critical_0_001(dof), (stat, dof)
        else:  # the penalties change the law
            assert counts.sum() < len(outputs) or stat > critical_0_001(dof)
    plain = [int(scripted_logits(prompt, 1.0).argmax())]
    assert all(s.token_ids[2:3] == plain for s in greedy)


# Undrafted, the draft model at k = 4, prompt lookup at k = 8: seeded rows' drafters.
DRAFTERS = [
    dict(num_draft_tokens=0),
    dict(num_draft_tokens=4, fixed_num_draft_tokens=True, proposers=("draft_model",)),
    dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("ngram",)),
]


def test_seeded_rows_with_controls_do_not_depend_on_the_drafter():
    """The same seeded sampled request with every control, undrafted, drafted by the model at
    k = 4 and by prompt lookup at k = 8, in one batch: the same tokens."""
    scheduler = scripted_scheduler()
    prompt = [1, 2, 1, 2, 1, 2, 1]  # prompt lookup finds matches
    for seed in range(40):
        sequences = [
            scheduler.submit(
                scripted_request(prompt, 12, temperature=0.8, seed=seed, **d, **CONTROLS["all"])
            )
            for d in DRAFTERS
        ]
        run_all(scheduler)
        plain, *drafted = [s.token_ids for s in sequences]
        assert all(tokens == plain for tokens in drafted), seed


# -- the real engines, in process ------------------------------------------------------------
NUM_SLOTS = 16
MAX_CONTEXT = 256
MAX_TOKENS = 24
PROMPT = "<|im_start|>user\nList the days of the week, twice.<|im_end|>\n<|im_start|>assistant\n"
SPECULATION = {
    "k0": dict(num_draft_tokens=0),
    "k1": dict(num_draft_tokens=1, fixed_num_draft_tokens=True, proposers=("draft_model",)),
    "k4": dict(num_draft_tokens=4, fixed_num_draft_tokens=True, proposers=("draft_model",)),
    "k8": dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("draft_model",)),
    "ngram-k8": dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("ngram",)),
    "suffix-k8": dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("suffix",)),
    "adaptive": {},
}


def real_controls(tokenizer) -> dict[str, dict]:
    """One request's controls per name, with token ids of this tokenizer."""
    # Plain decoding answers "Here's a Python function that uses ...": words it would say.
    word = tokenizer.encode(" Python", add_special_tokens=False)
    two = tokenizer.encode(" function that", add_special_tokens=False)
    assert len(word) == 1 and len(two) == 2
    return {
        "repetition": dict(repetition_penalty=1.3),
        "presence-frequency": dict(presence_penalty=0.8, frequency_penalty=0.5),
        "logit-bias": dict(logit_bias={word[0]: -6.0, tokenizer.encode("1")[0]: 4.0}),
        "bad-words": dict(bad_words_ids=[two]),
        "bad-word": dict(bad_words_ids=[word]),
        "min-p": dict(min_p=0.2),  # greedy: the argmax always stays
    }


class PresenceFrequency:
    """transformers has no presence or frequency penalty: a LogitsProcessor for it, over the
    prompt and the output (TensorRT-LLM's default, prompt_ignore_length 0), or over the
    tokens after the first `ignored` (OpenAI's: the output only)."""

    def __init__(self, presence: float, frequency: float, ignored: int = 0) -> None:
        self.presence, self.frequency, self.ignored = presence, frequency, ignored

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counted = input_ids[:, self.ignored :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, counted, torch.ones_like(counted, dtype=scores.dtype)
        )
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


def hf_reference(hf_target, prompt_ids: list[int], controls: dict, end_id: int) -> list[int]:
    """transformers' greedy generate with the same processing, its own processors where it
    has them."""
    from transformers import LogitsProcessorList

    _, model = hf_target
    kw: dict = {}
    if "repetition_penalty" in controls:
        kw["repetition_penalty"] = controls["repetition_penalty"]
    if "logit_bias" in controls:
        kw["sequence_bias"] = {(t,): v for t, v in controls["logit_bias"].items()}
    if "bad_words_ids" in controls:
        kw["bad_words_ids"] = controls["bad_words_ids"]
    if "presence_penalty" in controls:
        ignored = min(controls.get("prompt_ignore_length", 0), len(prompt_ids))
        kw["logits_processor"] = LogitsProcessorList(
            [
                PresenceFrequency(
                    controls["presence_penalty"], controls["frequency_penalty"], ignored
                )
            ]
        )
    if "min_p" in controls:
        kw["min_p"] = controls["min_p"]  # greedy: the argmax always stays
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, **kw
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    return tokens[: tokens.index(end_id)] if end_id in tokens else tokens


@pytest.fixture(scope="module")
def real(target_dir):
    tokenizer = load_tokenizer(str(target_dir))
    engines = {
        dtype: LocalEngines(
            LlamaEngine.from_checkpoint(DRAFT, NUM_SLOTS, MAX_CONTEXT, dtype=dtype),
            LlamaEngine.from_checkpoint(target_dir, NUM_SLOTS, MAX_CONTEXT, dtype=dtype),
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    return tokenizer, engines


def real_scheduler(engines: LocalEngines, tokenizer, **config) -> SpeculativeScheduler:
    """The real engines' loop with every proposer (and `config`'s other settings)."""
    proposers = ("draft_model", "ngram", "suffix")
    settings = dict(max_draft_tokens=8, default_draft_tokens=None, max_queue=256, **config)
    loop_config = SchedulerConfig(NUM_SLOTS, MAX_CONTEXT, proposer_names=proposers, **settings)
    return SpeculativeScheduler(engines, loop_config, tokenizer.decode)


def real_request(tokenizer, **kw) -> GenerationRequest:
    ids = tokenizer.encode(PROMPT)
    return GenerationRequest(
        prompt=None, prompt_ids=ids, max_tokens=MAX_TOKENS, end_id=tokenizer.eos_token_id, **kw
    )


def output_of(sequence: SequenceState) -> list[int]:
    return sequence.token_ids[len(sequence.request.prompt_ids) :]


def test_greedy_with_each_control_equals_transformers_at_every_k(real, hf_target):
    """float32: each control at k = 0, 1, 4, 8, with the draft model, prompt lookup, the suffix
    store and adaptively, all in one batch beside rows without controls, gives transformers'
    tokens with the same processing; and the controls change the output."""
    tokenizer, engines = real
    scheduler = real_scheduler(engines[torch.float32], tokenizer)
    controls = real_controls(tokenizer)
    runs = {
        (name, how): scheduler.submit(real_request(tokenizer, **c, **SPECULATION[how]))
        for name, c in controls.items()
        for how in SPECULATION
    }
    bystanders = [scheduler.submit(real_request(tokenizer, **SPECULATION[h])) for h in ("k4", "k0")]
    run_all(scheduler)
    plain = hf_reference(hf_target, bystanders[0].request.prompt_ids, {}, tokenizer.eos_token_id)
    assert [output_of(s) for s in bystanders] == [plain, plain]
    for name, c in controls.items():
        expected = hf_reference(
            hf_target, runs[name, "k0"].request.prompt_ids, c, tokenizer.eos_token_id
        )
        assert name == "min-p" or expected != plain, f"{name} changes nothing here"
        for how in SPECULATION:
            assert output_of(runs[name, how]) == expected, (name, how)
    accepted = {how: 0 for how in SPECULATION}
    for (_, how), sequence in runs.items():
        accepted[how] += sequence.stats.num_accepted_draft_tokens
    assert all(accepted[how] > 0 for how in SPECULATION if how != "k0"), accepted


def test_bfloat16_with_controls_parts_from_plain_decoding_only_at_near_ties(real):
    """bfloat16: with every control at once, speculative output equals plain decoding's (k = 0,
    same controls) up to the first position where plain decoding's processed top-2 logits lie
    within the tie margin."""
    tokenizer, engines = real
    scheduler = real_scheduler(engines[torch.bfloat16], tokenizer)
    controls = real_controls(tokenizer)
    every = {**controls["repetition"], **controls["presence-frequency"], **controls["logit-bias"]}
    every["bad_words_ids"] = controls["bad-words"]["bad_words_ids"]
    sequences = [
        scheduler.submit(real_request(tokenizer, **every, **SPECULATION[how]))
        for how in ("k0", "k4", "ngram-k8")
    ]
    run_all(scheduler)
    plain, *drafted = [output_of(s) for s in sequences]
    target = engines[torch.bfloat16].target_engine
    for tokens in drafted:
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b), None
        )
        if first is None:
            assert len(tokens) == len(plain)
            continue
        before = list(sequences[0].request.prompt_ids) + plain[:first]
        logits = target.forward(torch.tensor(before), [len(before)], [0], [0], [1])[0]
        processed = reference_logits(logits, before, sequences[0].request)
        top2 = processed.topk(2).values
        assert float(top2[0] - top2[1]) < TIE_MARGIN, (first, top2)


def test_counts_follow_prefix_reuse_copies_chunked_prefill_and_cancellation(real, hf_target):
    """float32, with penalties that count the prompt and a bad word of two tokens: a prompt
    prefilled in chunks of 16; two return sequences (the second's prompt cache is copied);
    a controlled row cancelled mid-way beside them; then the same prompt again (its prefix
    reused from the cache). Every row that finishes gives transformers' tokens."""
    tokenizer, engines = real
    scheduler = real_scheduler(
        engines[torch.float32], tokenizer, prefix_min_tokens=16, prefill_chunk=16
    )
    text = (
        "<|im_start|>user\nHere is a list: apples, pears, plums, apples, pears, plums, "
        "apples, cherries, pears, figs. Repeat the list twice, then count the apples."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    assert len(ids) > 2 * 16  # three chunks
    pears = tokenizer.encode(" pears,", add_special_tokens=False)
    assert len(pears) == 2
    controls = dict(
        repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3, bad_words_ids=[pears]
    )

    def request(**kw) -> GenerationRequest:
        return GenerationRequest(
            prompt=None,
            prompt_ids=ids,
            max_tokens=MAX_TOKENS,
            end_id=tokenizer.eos_token_id,
            **controls,
            **kw,
        )

    twins = scheduler.submit_all([request(num_return_sequences=2, **SPECULATION["k4"])])
    victim = scheduler.submit(request(**SPECULATION["ngram-k8"]))
    for _ in range(50):  # prefill in chunks, then a few tokens
        if victim.num_output_tokens >= 3:
            break
        scheduler.step()
    assert not victim.finished and victim.num_output_tokens >= 3
    scheduler.cancel(victim)
    run_all(scheduler)
    again = scheduler.submit(request(**SPECULATION["ngram-k8"]))
    run_all(scheduler)
    expected = hf_reference(hf_target, ids, controls, tokenizer.eos_token_id)
    plain = hf_reference(hf_target, ids, {}, tokenizer.eos_token_id)
    assert expected != plain
    assert victim.finish_reason == "cancelled"
    assert [output_of(s) for s in [*twins, again]] == [expected] * 3
    assert twins[1].num_copied_positions > 0 and again.num_copied_positions > 0


def test_the_controls_cross_the_wire_and_follow_a_split_call():
    """encode_call / decode_call keep every control field (the bad words' matrix too), and a
    call's rows taken apart (select_rows, as a split call does) keep their own controls with
    their row numbers remapped."""
    from specdec.engines.calls import select_rows
    from specdec.engines.wire import CONTROL_FIELDS, decode_call, encode_call

    rows = [
        sequence_of(scripted_request([1, 2, 3], repetition_penalty=1.5), [4], 0),
        sequence_of(scripted_request([5, 5]), [], 1),
        sequence_of(
            scripted_request([2, 2, 2], logit_bias={1: 2.0}, bad_words_ids=[[3], [1, 4, 2]]),
            [0, 1],
            2,
        ),
    ]
    batch = engine_batch(rows, [[4], [5, 5], [1]], [3, 0, 4], [1, 1, 1])
    _, decoded = decode_call(encode_call("target", batch))
    for name in CONTROL_FIELDS:
        assert np.array_equal(getattr(decoded, name), getattr(batch, name)), name
    assert decoded.bad_words.tolist() == [[1, 4, 2]]
    assert batch.has_controls().tolist() == [True, False, True]
    part = select_rows(batch, np.array([2, 0]))
    assert part.has_controls().tolist() == [True, True]
    assert part.repetition_penalty.tolist() == [1.0, 1.5]
    # row 0's whole cache (repetition), row 2's last two tokens (a bad word of three)
    assert part.history_rows.tolist() == [1, 1, 1, 0, 0]
    assert part.history_ids.tolist() == [1, 2, 3, 2, 0]
    biases = zip(part.bias_rows.tolist(), part.bias_ids.tolist(), strict=True)
    assert sorted(biases) == [(0, 1), (0, 3)]
    assert part.bad_word_rows.tolist() == [0] and part.bad_words.tolist() == [[1, 4, 2]]
