"""Guided decoding under speculation (specdec/engines/grammar.py): the grammar masks every
position an engine chooses, along the proposals, and the output is exactly plain guided
decoding's.

- Engine calls over a scripted six-token vocabulary (test_controls' ScriptedEngine) with a
  regex: each position of a verify is the masked argmax after exactly the tokens before it,
  and each draft step follows the grammar; a position with nothing left (the grammar allows
  only the end token, min_tokens forbids it) ends the request with an error naming the guide.
- Through the loop: sampled guided rows follow the masked target's law (chi-square over every
  emitted position, the bonus included), and seeded ones give the same tokens whoever drafts.
- The real engines in process: greedy output under a JSON schema, any JSON, a regex and an
  EBNF grammar equals transformers' generate with xgrammar's logits processor (float32), at
  k = 0, 1, 4 and 8 and with each proposer, beside rows without a guide; and it survives
  chunked prefill, return sequences, cancellation and prefix reuse.
- Refusals name the field; the matcher cache's rollback and rebuild mask as a fresh one.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from jsonschema import validate
from test_controls import (
    DRAFTERS,
    SPECULATION,
    VOCAB,
    ScriptedEngine,
    output_of,
    run_all,
    scripted_logits,
    sequence_of,
)

from conftest import DRAFT
from specdec.engines.calls import LocalEngines, run_draft, run_target
from specdec.engines.grammar import Grammars, PositionedMatchers, new_bitmask
from specdec.engines.llama import LlamaEngine
from specdec.loop.config import SchedulerConfig
from specdec.loop.scheduler import SpeculativeScheduler
from specdec.loop.sequence import engine_batch
from specdec.text.request import GenerationRequest, Guide, InvalidInput, parse_request
from specdec.text.tokenizer import load_tokenizer
from stats import chi_square, critical_0_001

# -- a scripted vocabulary: one character per token, "$" ends -------------------------------
CHARACTERS = ["a", "b", "c", "d", "e", "$"]
END = 5
# Two choices, two choices, then one of three, again and again; the end token from the third.
PATTERN = Guide("regex", "(a|b)(a|c)(b|d|e)+")


@pytest.fixture(scope="module")
def scripted_grammars() -> Grammars:
    info = xgr.TokenizerInfo(CHARACTERS, stop_token_ids=[END])
    return Grammars(info, VOCAB)


def allowed_after(grammars: Grammars, guide: Guide, output: list[int]) -> set[int] | None:
    """The tokens a fresh matcher allows after `output`; None where the output already left
    the grammar (or ended)."""
    matcher = grammars.matcher(guide.pair, END)
    for token in output:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return None
    if matcher.is_terminated():
        return None
    bitmask = new_bitmask(1, grammars.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return {t for t in range(grammars.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1}


def masked_argmax(logits: torch.Tensor, allowed: set[int]) -> int:
    masked = torch.full_like(logits, float("-inf"))
    index = torch.tensor(sorted(allowed))
    masked[index] = logits[index]
    return int(masked.argmax())


def guided_request(prompt: list[int], max_tokens: int = 4, **kw) -> GenerationRequest:
    kw.setdefault("guide", PATTERN)
    kw.setdefault("end_id", END)
    return GenerationRequest(prompt=None, prompt_ids=prompt, max_tokens=max_tokens, **kw)


def test_each_verified_position_is_masked_after_exactly_the_tokens_before_it(
    scripted_grammars,
):
    """A verify of pending + proposals, one of which the grammar forbids: up to it, the
    target's token at each position is the masked argmax after the output before that
    position, proposals included. A row without a guide rides along unmasked."""
    engine = ScriptedEngine(2, 64, sharpness=1.0)
    matchers = PositionedMatchers(scripted_grammars)
    prompt, output = [3, 3], [0]  # "a" so far
    proposals = [2, 3, 1, 0, 4]  # "c", "d", "b" follow the grammar; "a" does not
    rows = [
        sequence_of(guided_request(prompt), output, 0),
        sequence_of(guided_request(prompt, guide=None), output, 1),
    ]
    cached = len(prompt) + len(output) - 1
    engine.forward(prompt, [cached], [0], [0], [1])
    engine.forward(prompt, [cached], [1], [0], [1])
    pending = [r.token_ids[cached:] + proposals for r in rows]
    batch = engine_batch(rows, pending, [cached, cached], [len(proposals) + 1] * 2)
    tokens = run_target(engine, batch, matchers).token_ids
    sequence = prompt + output + proposals
    checked = 0
    for j in range(len(proposals) + 1):
        before = sequence[: len(prompt) + len(output) + j]
        logits = scripted_logits(before, 1.0)
        assert tokens[1, j] == int(logits.argmax()), j
        allowed = allowed_after(scripted_grammars, PATTERN, before[len(prompt) :])
        if allowed is None:
            continue  # after the forbidden proposal: never read
        assert tokens[0, j] == masked_argmax(logits, allowed), j
        checked += 1
    assert checked == 4


def test_each_draft_step_follows_the_grammar(scripted_grammars):
    """The draft masks each of its steps after its own proposals so far."""
    engine = ScriptedEngine(1, 64, sharpness=1.0)
    matchers = PositionedMatchers(scripted_grammars)
    prompt = [1, 1]
    row = sequence_of(guided_request(prompt), [], 0)
    batch = engine_batch([row], [prompt], [0], [5])
    proposals = run_draft(engine, batch, matchers).token_ids[0].tolist()
    output: list[int] = []
    for step, token in enumerate(proposals):
        allowed = allowed_after(scripted_grammars, PATTERN, output)
        assert allowed is not None, step
        assert token == masked_argmax(scripted_logits(prompt + output, 1.0), allowed), step
        output.append(token)
    assert re.fullmatch("(a|b)(a|c)(b|d|e)*", "".join(CHARACTERS[t] for t in output))


def scripted_scheduler(grammars: Grammars, num_slots: int = 16) -> SpeculativeScheduler:
    engines = LocalEngines(
        ScriptedEngine(num_slots, 64, sharpness=1.6),
        ScriptedEngine(num_slots, 64, sharpness=1.0),
        grammars,
    )
    config = SchedulerConfig(
        num_slots, 64, max_draft_tokens=8, default_draft_tokens=None, max_queue=10_000
    )
    return SpeculativeScheduler(engines, config, lambda ids: "".join(map(str, ids)))


def masked_law(grammars: Grammars, prompt: list[int], length: int, guide: Guide | None) -> dict:
    """P(output) of a sampled row (temperature 1) of up to `length` tokens, the end token
    ending it (and not in the output), under the grammar's mask (None: no mask)."""
    law, done = {(): 1.0}, {}
    for _ in range(length):
        grown: dict = {}
        for seq, p in law.items():
            probs = torch.softmax(scripted_logits(prompt + list(seq), 1.0).double(), dim=-1)
            if guide is not None:
                allowed = allowed_after(grammars, guide, list(seq)) or set()
                keep = torch.zeros_like(probs)
                keep[sorted(allowed)] = 1.0
                probs = probs * keep / (probs * keep).sum()
            for t, q in enumerate(probs.tolist()):
                if q > 0:
                    target = done if t == END else grown
                    key = seq if t == END else seq + (t,)
                    target[key] = target.get(key, 0.0) + p * q
        law = grown
    for seq, p in law.items():
        done[seq] = done.get(seq, 0.0) + p
    return done


def test_sampled_guided_rows_follow_the_masked_target(scripted_grammars):
    """Sampled guided rows drafted at k = 3, max_tokens 4 (the bonus included), the end
    token allowed from the fourth, beside greedy rows without a guide: the law of the whole
    output is the masked target's. Negative control: against the unmasked law they fail."""
    scheduler = scripted_scheduler(scripted_grammars)
    prompt = [2, 2]
    draft = dict(num_draft_tokens=3, fixed_num_draft_tokens=True, proposers=("draft_model",))
    sampled, plain = [], []
    for i in range(3_000):
        if i % 4 == 3:
            plain.append(scheduler.submit(guided_request(prompt, guide=None, **draft)))
            continue
        sampled.append(scheduler.submit(guided_request(prompt, temperature=1.0, seed=i, **draft)))
    run_all(scheduler)
    assert sum(s.stats.num_accepted_draft_tokens for s in sampled) > 0
    outputs = [tuple(output_of(s)) for s in sampled]
    for guide in (PATTERN, None):
        law = masked_law(scripted_grammars, prompt, 4, guide)
        cells = sorted(law)
        counts = torch.tensor([float(outputs.count(cell)) for cell in cells])
        stat, dof = chi_square(counts, torch.tensor([law[c] for c in cells]))
        if guide is not None:
            assert counts.sum() == len(outputs), "an output the masked target never emits"
            assert stat < critical_0_001(dof), (stat, dof)
        else:
            assert counts.sum() < len(outputs) or stat > critical_0_001(dof)
    unmasked = [int(scripted_logits(prompt, 1.0).argmax())]
    assert all(output_of(s)[:1] == unmasked for s in plain)


def test_seeded_guided_rows_do_not_depend_on_the_drafter(scripted_grammars):
    """The same seeded guided request undrafted, drafted by the model at k = 4 and by prompt
    lookup at k = 8, in one batch: the same tokens."""
    scheduler = scripted_scheduler(scripted_grammars)
    prompt = [0, 2, 3, 0, 2, 3, 0]  # prompt lookup finds matches
    for seed in range(30):
        sequences = [
            scheduler.submit(guided_request(prompt, 10, temperature=0.8, seed=seed, **d))
            for d in DRAFTERS
        ]
        run_all(scheduler)
        first, *drafted = [output_of(s) for s in sequences]
        assert all(tokens == first for tokens in drafted), seed


def test_a_position_with_no_token_left_ends_the_request_with_an_error(scripted_grammars):
    """A grammar complete after two tokens allows only the end token, which min_tokens 4
    forbids: the request ends with an error naming the guide, at k = 0 and drafted; a row
    beside it goes on."""
    scheduler = scripted_scheduler(scripted_grammars)
    stuck = Guide("regex", "ab")
    rows = [
        scheduler.submit(guided_request([1, 1], 6, guide=stuck, min_tokens=4, **kw))
        for kw in (
            dict(num_draft_tokens=0),
            dict(num_draft_tokens=4, fixed_num_draft_tokens=True, proposers=("draft_model",)),
        )
    ]
    bystander = scheduler.submit(guided_request([1, 1], 6))
    run_all(scheduler)
    for row in rows:
        assert row.finish_reason == "error"
        assert row.error.startswith("guided_decoding_guide: no token is left at output token 3")
        assert output_of(row) == [0, 1]
    assert bystander.finish_reason in ("end", "length") and len(output_of(bystander)) >= 3


def test_the_grammar_proposes_what_it_forces_and_the_target_takes_it_all(scripted_grammars):
    """A regex that forces three tokens, leaves a choice, then forces two and the end: the
    grammar proposer proposes the forced runs (no model call), every one is accepted, and the
    output is k = 0's, greedy and seeded sampled alike."""
    scheduler = scripted_scheduler(scripted_grammars)
    forced = Guide("regex", "abc(d|e)ab")
    grammar = dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("grammar",))
    runs = []
    for sampling in (dict(), dict(temperature=1.0, seed=3)):
        runs.append(
            [
                scheduler.submit(guided_request([2, 2], 8, guide=forced, **how, **sampling))
                for how in (dict(num_draft_tokens=0), grammar)
            ]
        )
    run_all(scheduler)
    for plain, proposed in runs:
        assert output_of(proposed) == output_of(plain)
        assert "".join(CHARACTERS[t] for t in output_of(plain)) in ("abcdab", "abceab")
        # "abc", then "ab" and the end token: two passes where k = 0 takes seven
        assert proposed.stats.num_draft_tokens == proposed.stats.num_accepted_draft_tokens == 6
        assert (proposed.stats.num_target_passes, plain.stats.num_target_passes) == (2, 7)


def test_the_grammar_proposes_a_lookup_after_what_it_forces(scripted_grammars):
    """After the forced "a", prompt lookup finds what followed "a" in the prompt ("deb"), and
    the grammar allows all of it: one offer of four tokens, keyed by one forced token; where
    the grammar forbids the lookup's second token, the offer stops before it."""
    from types import SimpleNamespace

    from specdec.loop.proposers.base import Candidate
    from specdec.loop.proposers.grammar import GrammarProposer

    proposer = GrammarProposer(None, SimpleNamespace(grammars=scripted_grammars))  # type: ignore[arg-type]
    prompt = [0, 3, 4, 1]  # "adeb"
    for pattern, expected in (("a(d|b)(e|b)(b|d)c", [0, 3, 4, 1]), ("a(d|b)(a|b)dc", [0, 3])):
        row = sequence_of(guided_request(prompt, guide=Guide("regex", pattern)), [], 0)
        offer = proposer.offer(Candidate(row, 8))
        assert (offer.num_tokens, offer.key) == (len(expected), 1), pattern
        assert proposer.propose([row], [offer.num_tokens], [])[0].token_ids == expected
        proposer.release(row)


@pytest.fixture(scope="module")
def tokenizer_grammars(target_dir) -> dict[str, Grammars]:
    """The target tokenizer's grammars, by JSON whitespace."""
    return {
        whitespace: Grammars.for_tokenizer(str(target_dir), 49_152, json_whitespace=whitespace)
        for whitespace in ("compact", "any")
    }


def test_json_whitespace_is_compact_by_default_and_any_where_set(tokenizer_grammars):
    """Compact: one space after each comma and colon and none elsewhere, for a schema and for
    any JSON (an object or an array); any: whitespace anywhere between JSON's tokens."""
    schema = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "array"}}}))
    compact = ['{"a": [1, 2]}', '{"a": []}']
    spaced = ['{"a":[1,2]}', '{ "a": [1, 2] }', '{\n  "a": [1,\n 2]\n}']

    def completes(whitespace: str, guide, text: str) -> bool:
        matcher = tokenizer_grammars[whitespace].matcher(guide, 2)
        return matcher.accept_string(text) and matcher.is_completed()

    for text in compact:
        assert completes("compact", schema, text) and completes("any", schema, text), text
        assert completes("compact", ("json", ""), text), text
    for text in spaced:
        assert not completes("compact", schema, text) and completes("any", schema, text), text
        assert not completes("compact", ("json", ""), text), text
        assert completes("any", ("json", ""), text), text
    assert completes("compact", ("json", ""), "[1, {}]")
    assert not completes("compact", ("json", ""), '"text"')
    with pytest.raises(ValueError, match="json_whitespace"):
        Grammars(tokenizer_grammars["any"].info, 49_152, json_whitespace="pretty")


def test_the_grammar_proposes_the_text_it_writes_itself_as_the_tokenizer_splits_it(
    tokenizer_grammars, target_dir
):
    """A schema's keys and punctuation are no single-token certainty (the vocabulary spells
    '{"name' several ways), yet the grammar writes them: the proposer offers them as the
    tokenizer splits them, then prompt lookup's continuation where the grammar allows it,
    keyed by how many of the offer's tokens are the grammar's own."""
    from types import SimpleNamespace

    from specdec.loop.proposers.base import Candidate
    from specdec.loop.proposers.grammar import GrammarProposer

    tokenizer = load_tokenizer(str(target_dir))
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
    }
    guide = Guide("json_schema", json.dumps(schema))
    grammars = tokenizer_grammars["compact"]
    proposer = GrammarProposer(None, SimpleNamespace(grammars=grammars))  # type: ignore[arg-type]
    prompt = tokenizer.encode("Ada from Paris")
    cases = (  # output so far, the grammar's own text, the lookup's text after it
        ("", '{"name": "', ""),
        ('{"name": "Ada"', ', "city": "', ""),
        ('{"name": "Ada", "city": "Paris"', "}</s>", ""),  # then the end token, forced
        ('{"name": "Ada from', "", " Paris"),  # the grammar writes nothing: the lookup
    )
    for output, own, looked_up in cases:
        output_ids = tokenizer.encode(output) if output else []
        row = sequence_of(guided_request(prompt, 64, guide=guide, end_id=2), output_ids, 0)
        offer = proposer.offer(Candidate(row, 8))
        proposal = proposer.propose([row], [offer.num_tokens], [])[0].token_ids
        own_ids = tokenizer.encode(own.removesuffix("</s>")) if own else []
        own_ids += [2] if own.endswith("</s>") else []
        assert proposal[: len(own_ids)] == own_ids, (output, tokenizer.decode(proposal))
        assert tokenizer.decode(proposal[len(own_ids) :]).startswith(looked_up), output
        assert offer.key == min(len(own_ids), 4), output
        proposer.release(row)


def test_positioned_matchers_roll_back_and_rebuild_as_a_fresh_matcher(scripted_grammars):
    """One slot's matcher asked for a longer text, a shorter one (rejected proposals), a
    different one (a new request in the slot), another guide: each mask is a fresh
    matcher's."""
    matchers = PositionedMatchers(scripted_grammars)
    texts = [[0, 2, 3, 1], [0, 2], [0, 2, 4, 4, 3], [1, 0], [1, 0, 1, 1, 1, 1]]
    for guide in (PATTERN, Guide("regex", "(a|b)(a|b|c|d|e)*")):
        for text in texts:
            matcher = matchers.at(("target", 0), guide.pair, END, text)
            expected = allowed_after(scripted_grammars, guide, text)
            if expected is None:
                assert matcher is None
                continue
            bitmask = new_bitmask(1, VOCAB)
            matcher.fill_next_token_bitmask(bitmask, 0)
            got = {t for t in range(VOCAB) if int(bitmask[0, 0]) >> t & 1}
            assert got == expected, (guide, text)


def test_the_guide_crosses_the_wire_and_follows_a_split_call(scripted_grammars):
    from specdec.engines.calls import select_rows
    from specdec.engines.wire import CONTROL_FIELDS, decode_call, encode_call

    schema = Guide("json_schema", '{"type": "object", "description": "é"}')
    rows = [
        sequence_of(guided_request([1, 2, 3]), [0], 0),
        sequence_of(guided_request([5], guide=None), [], 1),
        sequence_of(guided_request([2, 2], guide=schema), [4, 4, 4], 2),
    ]
    batch = engine_batch(rows, [[0], [5], [4]], [3, 0, 4], [1, 1, 1])
    _, decoded = decode_call(encode_call("target", batch))
    for name in CONTROL_FIELDS:
        assert np.array_equal(getattr(decoded, name), getattr(batch, name)), name
    assert batch.has_controls().tolist() == [True, False, True]
    part = select_rows(decoded, np.array([2, 0]))
    assert part.guide_rows.tolist() == [1, 0]
    assert [t.decode() for t in part.guides] == [PATTERN.text, schema.text]
    assert part.guide_starts.tolist() == [3, 2]
    # the output before each cache length: row 2's first two of three, none of row 0's
    assert part.history_rows.tolist() == [0, 0] and part.history_ids.tolist() == [4, 4]


# -- requests: refusals --------------------------------------------------------------------
def parse(grammars: Grammars, **inputs) -> GenerationRequest:
    arrays = {"input_ids": np.array([[1, 2]], dtype=np.int32), "max_tokens": np.array([[4]])}
    for name, value in inputs.items():
        arrays[name] = (
            np.array([[value.encode()]], dtype=np.object_) if isinstance(value, str) else value
        )
    return parse_request(
        arrays,
        tokenize=lambda text: [1],
        max_context=64,
        max_draft_tokens=8,
        default_end_id=END,
        check_guide=lambda guide: grammars.compile(guide.pair),
    )


@pytest.mark.parametrize(
    "inputs, field, words",
    [
        (dict(guided_decoding_guide_type="xml"), "guided_decoding_guide_type", "'xml'"),
        (dict(guided_decoding_guide_type="regex"), "guided_decoding_guide", "required"),
        (dict(guided_decoding_guide="a+"), "guided_decoding_guide_type", "required"),
        (
            dict(guided_decoding_guide_type="json_schema", guided_decoding_guide="{not json"),
            "guided_decoding_guide",
            "not a valid json_schema",
        ),
        (
            dict(guided_decoding_guide_type="regex", guided_decoding_guide="(a|"),
            "guided_decoding_guide",
            "not a valid regex",
        ),
        (
            dict(guided_decoding_guide_type="ebnf_grammar", guided_decoding_guide="root ::= ("),
            "guided_decoding_guide",
            "not a valid ebnf_grammar",
        ),
        (
            dict(
                guided_decoding_guide_type="regex",
                guided_decoding_guide="a",
                end_id=np.array([[-1]], dtype=np.int32),
            ),
            "end_id",
            "end token",
        ),
        (
            dict(guided_decoding_guide_type="regex", guided_decoding_guide="a" * 70_000),
            "guided_decoding_guide",
            "at most",
        ),
    ],
)
def test_a_bad_guide_is_refused_naming_its_field(scripted_grammars, inputs, field, words):
    with pytest.raises(InvalidInput) as refused:
        parse(scripted_grammars, **inputs)
    assert refused.value.field == field
    assert words in str(refused.value)


def test_a_good_guide_parses_and_compiled_grammars_stay_within_their_bound():
    info = xgr.TokenizerInfo(CHARACTERS, stop_token_ids=[END])
    grammars = Grammars(info, VOCAB, cache_bytes=64 << 10)
    request = parse(grammars, guided_decoding_guide_type="json")
    assert request.guide == Guide("json") and request.has_logit_controls
    for n in range(200):
        grammars.compile(("regex", f"(a|b){{{n + 1}}}c"))
    assert 0 < grammars.cache_bytes <= 64 << 10


# -- the real engines, in process ------------------------------------------------------------
NUM_SLOTS = 16
MAX_CONTEXT = 320
MAX_TOKENS = 32
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
}
CASES = {  # guide, question
    "json_schema": (
        Guide("json_schema", json.dumps(PERSON)),
        "Extract the person as JSON: Alice is 31 and lives in Paris.",
    ),
    "json": (Guide("json"), "Give me a JSON object with a title and a year for a film."),
    "regex": (
        Guide("regex", "(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)\\."),
        "What day comes after Monday? Answer with one word.",
    ),
    "ebnf_grammar": (
        Guide("ebnf_grammar", 'root ::= "Answer: " ("yes" | "no") ", because " [a-z ]+ "."'),
        "Is the sky blue on a clear day?",
    ),
}


@pytest.fixture(scope="module")
def real(target_dir):
    tokenizer = load_tokenizer(str(target_dir))
    grammars = Grammars.for_tokenizer(str(target_dir), 49_152)
    engines = LocalEngines(
        LlamaEngine.from_checkpoint(DRAFT, NUM_SLOTS, MAX_CONTEXT, dtype=torch.float32),
        LlamaEngine.from_checkpoint(target_dir, NUM_SLOTS, MAX_CONTEXT, dtype=torch.float32),
        grammars,
    )
    return tokenizer, engines


GUIDED_SPECULATION = {
    **SPECULATION,
    "grammar-k8": dict(num_draft_tokens=8, fixed_num_draft_tokens=True, proposers=("grammar",)),
}


def modes_of(case: str) -> list[str]:
    """Every k and proposer for the JSON schema; for the other guides, plain decoding, the
    draft model and the grammar (the suite's time)."""
    if case == "json_schema":
        return list(GUIDED_SPECULATION)
    return ["k0", "k4", "grammar-k8"]


def real_scheduler(engines: LocalEngines, **config) -> SpeculativeScheduler:
    proposers = ("draft_model", "ngram", "suffix", "grammar")
    settings = dict(max_draft_tokens=8, default_draft_tokens=None, max_queue=256, **config)
    loop_config = SchedulerConfig(NUM_SLOTS, MAX_CONTEXT, proposer_names=proposers, **settings)
    tokenizer = load_tokenizer(str(DRAFT.parent / "smollm2-135m-instruct"))
    return SpeculativeScheduler(engines, loop_config, tokenizer.decode)


def hf_guided(
    hf_target, grammars: Grammars, prompt_ids: list[int], guide: Guide | None
) -> list[int]:
    """transformers' greedy generate with xgrammar's own logits processor (none: plain)."""
    from xgrammar.contrib.hf import LogitsProcessor

    _, model = hf_target
    kw = (
        {}
        if guide is None
        else {"logits_processor": [LogitsProcessor(grammars.compile(guide.pair))]}
    )
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, **kw
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    return tokens[: tokens.index(2)] if 2 in tokens else tokens


def test_greedy_guided_output_equals_transformers_at_every_k(real, hf_target):
    """float32: a JSON schema at k = 0, 1, 4, 8, with the draft model, prompt lookup, the suffix
    store, the grammar itself and adaptively, and any JSON, a regex and an EBNF grammar with
    a few of them (modes_of), in one batch beside rows without a guide, gives
    transformers' tokens under xgrammar's own processor; the guide changes the output, the
    grammar's proposals are taken, and the JSON validates."""
    tokenizer, engines = real
    scheduler = real_scheduler(engines)
    prompts = {
        name: tokenizer.encode(tokenizer.apply_chat_template(question))
        for name, (_, question) in CASES.items()
    }
    runs = {
        (name, how): scheduler.submit(
            GenerationRequest(
                prompt=None,
                prompt_ids=prompts[name],
                max_tokens=MAX_TOKENS,
                end_id=tokenizer.eos_token_id,
                guide=guide,
                **GUIDED_SPECULATION[how],
            )
        )
        for name, (guide, _) in CASES.items()
        for how in modes_of(name)
    }
    bystanders = {
        name: scheduler.submit(
            GenerationRequest(
                prompt=None,
                prompt_ids=prompts[name],
                max_tokens=MAX_TOKENS,
                end_id=tokenizer.eos_token_id,
                **SPECULATION["k4"],
            )
        )
        for name in ("json_schema", "regex")
    }
    run_all(scheduler)
    grammars = engines.grammars
    assert grammars is not None
    for name, bystander in bystanders.items():
        assert output_of(bystander) == hf_guided(hf_target, grammars, prompts[name], None)
    for name, (guide, _) in CASES.items():
        expected = hf_guided(hf_target, grammars, prompts[name], guide)
        assert expected != hf_guided(hf_target, grammars, prompts[name], None), name
        for how in modes_of(name):
            assert output_of(runs[name, how]) == expected, (name, how)
        assert runs[name, "grammar-k8"].stats.num_accepted_draft_tokens > 0, name
    answer = json.loads(tokenizer.decode(output_of(runs["json_schema", "k0"])))
    validate(answer, PERSON)
    assert sum(s.stats.num_accepted_draft_tokens for s in runs.values()) > 0


def test_the_grammar_follows_chunked_prefill_copies_cancellation_and_prefix_reuse(real, hf_target):
    """A guided prompt prefilled in chunks of 16; two return sequences (the second's prompt
    cache copied); a guided row cancelled mid-way beside them; then the same prompt again
    (its prefix reused): every row that finishes gives transformers' guided tokens."""
    tokenizer, engines = real
    scheduler = real_scheduler(engines, prefix_min_tokens=16, prefill_chunk=16)
    guide, question = CASES["json_schema"]
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(question + " Use the keys name, age and city only.")
    )
    assert len(ids) > 2 * 16

    def request(**kw) -> GenerationRequest:
        return GenerationRequest(
            prompt=None,
            prompt_ids=ids,
            max_tokens=MAX_TOKENS,
            end_id=tokenizer.eos_token_id,
            guide=guide,
            **kw,
        )

    twins = scheduler.submit_all([request(num_return_sequences=2, **SPECULATION["k4"])])
    victim = scheduler.submit(request(**SPECULATION["ngram-k8"]))
    for _ in range(50):
        if victim.num_output_tokens >= 3:
            break
        scheduler.step()
    assert not victim.finished and victim.num_output_tokens >= 3
    scheduler.cancel(victim)
    run_all(scheduler)
    again = scheduler.submit(request(**SPECULATION["suffix-k8"]))
    run_all(scheduler)
    assert engines.grammars is not None
    expected = hf_guided(hf_target, engines.grammars, ids, guide)
    assert victim.finish_reason == "cancelled"
    assert [output_of(s) for s in [*twins, again]] == [expected] * 3
    assert twins[1].num_copied_positions > 0 and again.num_copied_positions > 0
