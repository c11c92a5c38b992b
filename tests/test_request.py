"""Input validation: every bad input is refused with a message that names its field."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.loop.proposers import PROPOSERS
from specdec.text.request import InvalidInput, parse_request, parse_requests, split_rows

VOCAB_SIZE = 300


def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
    return [ord(c) for c in text]


def parse(vocab_size: int = VOCAB_SIZE, **inputs):
    return parse_request(
        inputs,
        tokenize,
        max_context=16,
        max_draft_tokens=8,
        default_end_id=2,
        proposers=PROPOSERS,
        vocab_size=vocab_size,
    )


def floats(*values) -> np.ndarray:
    return np.array([values], dtype=np.float32)


def ints(*values) -> np.ndarray:
    return np.array([values], dtype=np.int32)


def words(*values: str) -> np.ndarray:
    return np.array([[v.encode() for v in values]], dtype=np.object_)


def text(value: str | bytes) -> np.ndarray:
    raw = value.encode() if isinstance(value, str) else value
    return np.array([[raw]], dtype=np.object_)


def i32(v):
    return np.array([[v]], dtype=np.int32)


def f32(v):
    return np.array([[v]], dtype=np.float32)


GOOD = {"text_input": text("hello"), "max_tokens": i32(4)}


def test_defaults():
    request = parse(**GOOD)
    assert request.prompt_ids == tokenize("hello")
    assert request.greedy and request.num_draft_tokens is None and request.end_id == 2
    assert not request.stream


@pytest.mark.parametrize(
    ("field", "inputs"),
    [
        ("text_input", {"max_tokens": i32(4)}),
        ("text_input", {**GOOD, "text_input": text("")}),
        ("text_input", {**GOOD, "text_input": text(b"\xff\xfe")}),
        ("text_input", {**GOOD, "text_input": text("x" * 17)}),
        ("text_input", {**GOOD, "text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}),
        ("text_input", {**GOOD, "text_input": np.array([[1.0]], dtype=np.float32)}),
        ("max_tokens", {"text_input": text("hi")}),
        ("max_tokens", {**GOOD, "max_tokens": i32(0)}),
        ("max_tokens", {**GOOD, "max_tokens": i32(-3)}),
        ("max_tokens", {**GOOD, "max_tokens": f32(3.0)}),
        ("max_tokens", {**GOOD, "max_tokens": i32(17)}),  # over the context
        ("temperature", {**GOOD, "temperature": f32(-0.1)}),
        ("temperature", {**GOOD, "temperature": f32(float("nan"))}),
        ("temperature", {**GOOD, "temperature": f32(float("inf"))}),
        ("top_p", {**GOOD, "top_p": f32(0.0)}),
        ("top_p", {**GOOD, "top_p": f32(1.5)}),
        ("top_k", {**GOOD, "top_k": i32(-1)}),
        ("num_draft_tokens", {**GOOD, "num_draft_tokens": i32(-1)}),
        ("num_draft_tokens", {**GOOD, "num_draft_tokens": i32(9)}),
        ("min_length", {**GOOD, "min_length": i32(-1)}),
        ("beam_width", {**GOOD, "beam_width": i32(2)}),
        ("beam_width", {**GOOD, "beam_width": i32(0)}),
        ("num_return_sequences", {**GOOD, "num_return_sequences": i32(0)}),
        ("num_return_sequences", {**GOOD, "num_return_sequences": i32(-2)}),
        ("num_return_sequences", {**GOOD, "num_return_sequences": i32(65)}),  # over the limit
        ("repetition_penalty", {**GOOD, "repetition_penalty": f32(0.0)}),
        ("repetition_penalty", {**GOOD, "repetition_penalty": f32(float("nan"))}),
        ("presence_penalty", {**GOOD, "presence_penalty": f32(float("inf"))}),
        ("frequency_penalty", {**GOOD, "frequency_penalty": i32(1)}),  # not a float
        ("length_penalty", {**GOOD, "length_penalty": f32(2.0)}),  # beam search only
        ("min_p", {**GOOD, "min_p": f32(1.5)}),
        ("min_p", {**GOOD, "min_p": f32(-0.1)}),
        ("prompt_ignore_length", {**GOOD, "prompt_ignore_length": i32(-1)}),
        ("logit_bias_ids", {**GOOD, "logit_bias_ids": ints(300), "logit_bias_values": floats(1)}),
        ("logit_bias_ids", {**GOOD, "logit_bias_ids": ints(-1), "logit_bias_values": floats(1)}),
        (
            "logit_bias_values",
            {**GOOD, "logit_bias_ids": ints(5), "logit_bias_values": floats(101)},
        ),
        (
            "logit_bias_values",
            {**GOOD, "logit_bias_ids": ints(5, 6), "logit_bias_values": floats(1)},
        ),
        (
            "embedding_bias_weights",
            {
                **GOOD,
                "embedding_bias_words": words("a", "b"),
                "embedding_bias_weights": floats(1.0),
            },
        ),
        (
            "embedding_bias_weights",
            {
                **GOOD,
                "embedding_bias_words": words("a"),
                "embedding_bias_weights": floats(float("nan")),
            },
        ),
        ("bad_words", {**GOOD, "bad_words": words("\u0400")}),  # token 1024: outside
        ("return_context_logits", {**GOOD, "return_context_logits": np.array([[True]])}),
        ("return_generation_logits", {**GOOD, "return_generation_logits": np.array([[True]])}),
        ("stop_words", {**GOOD, "stop_words": np.array([[b"a"], [b"b"]], dtype=np.object_)}),
        ("stream", {**GOOD, "stream": i32(1)}),
        ("proposer", {**GOOD, "proposer": text("medusa")}),
        (
            "proposer",
            {**GOOD, "proposer": np.array([[b"ngram", b"ngram"]], dtype=np.object_)},
        ),
        ("cache_salt", {**GOOD, "cache_salt": text("x" * 257)}),
        ("cache_salt", {**GOOD, "cache_salt": np.array([[b"a", b"b"]], dtype=np.object_)}),
        ("fixed_num_draft_tokens", {**GOOD, "fixed_num_draft_tokens": np.array([[True]])}),
        ("stream_interval", {**GOOD, "stream_interval": i32(0)}),
        ("stream_interval", {**GOOD, "stream_interval": i32(-4)}),
        ("stream_interval", {**GOOD, "stream_interval": f32(2.0)}),  # not an integer
        ("stream_interval", {**GOOD, "stream_interval": text("4")}),  # a string
        ("stream_interval", {**GOOD, "stream_interval": np.array([[True]])}),
        ("stream_interval", {**GOOD, "stream_interval": np.array([[2, 3]], dtype=np.int32)}),
    ],
)
def test_bad_input_names_its_field(field, inputs):
    with pytest.raises(InvalidInput) as raised:
        parse(**inputs)
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}:")


def test_stream_interval_is_the_requests_or_the_servers():
    assert parse(**GOOD).stream_interval == 1  # no server default given: 1
    assert parse(**GOOD, stream_interval=i32(4)).stream_interval == 4
    served = parse_request(GOOD, tokenize, 16, 8, 2, default_stream_interval=6)
    assert served.stream_interval == 6
    inputs = {**GOOD, "stream_interval": i32(1)}
    own = parse_request(inputs, tokenize, 16, 8, 2, default_stream_interval=6)
    assert own.stream_interval == 1  # the request's, even below the server's


def test_a_bad_stream_interval_in_a_batch_names_its_batch_index():
    good = parse_requests(
        {**GOOD, "stream_interval": i32(3)},
        tokenize,
        max_context=16,
        max_draft_tokens=8,
        default_end_id=2,
    )
    assert [r.stream_interval for r in good] == [3]
    with pytest.raises(InvalidInput, match=r"^stream_interval: .*batch_index 1"):
        parse_requests(
            {
                "text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                "max_tokens": i32(4),
                "stream_interval": np.array([[2], [0]], dtype=np.int32),
            },
            tokenize,
            max_context=16,
            max_draft_tokens=8,
            default_end_id=2,
        )


def test_prompt_at_the_context_length_is_accepted():
    assert len(parse(**{**GOOD, "text_input": text("x" * 16)}).prompt_ids) == 16


def test_aliases_and_neutral_values():
    request = parse(
        **GOOD,
        random_seed=np.array([[2**64 - 1]], dtype=np.uint64),
        min_length=i32(3),
        beam_width=i32(1),
        repetition_penalty=f32(1.0),
        return_log_probs=np.array([[False]]),
        stop_words=np.array([[b"END", b""]], dtype=np.object_),
        temperature=f32(0.7),
        top_k=i32(5),
    )
    assert request.seed == (2**64 - 1) & (2**63 - 1)
    assert request.min_tokens == 3
    assert request.stop_words == ["END"]
    assert not request.greedy and request.top_k == 5


def test_input_ids_take_precedence_over_text():
    request = parse(**GOOD, input_ids=np.array([[5, 6, 7]], dtype=np.int32))
    assert request.prompt_ids == [5, 6, 7]
    assert request.prompt == "hello"


def test_proposer_is_one_of_the_servers():
    request = parse(**GOOD, proposer=text("ngram"), num_draft_tokens=i32(4))
    assert request.proposers == ("ngram",) and request.num_draft_tokens == 4
    assert not request.fixed_num_draft_tokens
    several = np.array([[b"ngram", b"draft_model"]], dtype=np.object_)
    assert parse(**GOOD, proposer=several).proposers == ("ngram", "draft_model")
    assert parse(**GOOD).proposers == () and parse(**GOOD).cache_salt == ""
    assert parse(**GOOD, cache_salt=text("tenant-a")).cache_salt == "tenant-a"
    with pytest.raises(InvalidInput, match="proposer: each must be one of draft_model"):
        parse_request(
            {**GOOD, "proposer": text("ngram")},
            tokenize,
            max_context=16,
            max_draft_tokens=8,
            default_end_id=2,
            proposers=("draft_model",),
        )


def test_num_return_sequences_and_log_probs_are_served():
    request = parse(
        **GOOD, num_return_sequences=i32(3), return_log_probs=np.array([[True]]), beam_width=i32(1)
    )
    assert request.num_return_sequences == 3 and request.return_log_probs


def test_beam_search_refusal_says_what_to_use_instead():
    with pytest.raises(InvalidInput, match="beam_width: beam search is not supported.*got 2"):
        parse(**GOOD, beam_width=i32(2))


def parse_all(**inputs):
    limits = dict(max_context=16, max_draft_tokens=8, default_end_id=2)
    return parse_requests(inputs, tokenize, **limits)


def test_a_batch_of_prompts_is_one_request_each_with_its_batch_index():
    prompts = np.array([[b"ab"], [b"cde"], [b"f"]], dtype=np.object_)
    requests = parse_all(
        text_input=prompts,
        max_tokens=np.array([[4], [5], [6]], dtype=np.int32),
        temperature=f32(0.5),  # one row: applies to every prompt
        stop_words=np.array([[b"x"], [b"y"], [b"z"]], dtype=np.object_),
    )
    assert [r.prompt for r in requests] == ["ab", "cde", "f"]
    assert [r.max_tokens for r in requests] == [4, 5, 6]
    assert [r.batch_index for r in requests] == [0, 1, 2]
    assert [r.stop_words for r in requests] == [["x"], ["y"], ["z"]]
    assert all(r.temperature == 0.5 for r in requests)


def test_padded_input_ids_are_cut_to_their_lengths():
    rows = split_rows(
        {
            "input_ids": np.array([[5, 6, 0], [7, 8, 9]], dtype=np.int32),
            "input_lengths": np.array([[2], [3]], dtype=np.int32),
            "max_tokens": i32(4),
        }
    )
    assert [r["input_ids"].tolist() for r in rows] == [[[5, 6]], [[7, 8, 9]]]
    assert all("input_lengths" not in r for r in rows)


@pytest.mark.parametrize(
    ("field", "inputs", "message"),
    [
        (
            "max_tokens",
            {"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "max_tokens": i32(0)},
            "max_tokens: must be > 0, got 0 (batch_index 0)",
        ),
        (
            "text_input",
            {"text_input": np.array([[b"a"], [b""]], dtype=np.object_), "max_tokens": i32(2)},
            "text_input: empty prompt (batch_index 1)",
        ),
        (
            "max_tokens",
            {
                "text_input": np.array([[b"a"], [b"b"], [b"c"]], dtype=np.object_),
                "max_tokens": np.array([[1], [2]], dtype=np.int32),
            },
            "max_tokens: [2] rows for a batch of 3 prompts",
        ),
    ],
)
def test_a_bad_prompt_in_a_batch_refuses_the_request_naming_field_and_index(field, inputs, message):
    with pytest.raises(InvalidInput) as raised:
        parse_all(**inputs)
    assert raised.value.field == field
    assert str(raised.value) == message


def test_logit_controls_are_parsed():
    request = parse(
        **GOOD,
        repetition_penalty=f32(1.25),
        presence_penalty=f32(-0.5),
        frequency_penalty=f32(0.75),
        prompt_ignore_length=i32(3),
        min_p=f32(0.1),
        logit_bias_ids=ints(7, 8, 7),
        logit_bias_values=floats(1.5, -100, 2.0),
        embedding_bias_words=words("ab", "c"),
        embedding_bias_weights=floats(0.5, -1.0),
        bad_words=words("x", "yz"),
    )
    assert (request.repetition_penalty, request.presence_penalty) == (1.25, -0.5)
    assert (request.frequency_penalty, request.prompt_ignore_length) == (0.75, 3)
    assert request.min_p == pytest.approx(0.1)
    # a repeated id adds up; each token of a biased word gets the word's weight
    assert request.logit_bias == {7: 3.5, 8: -100.0, ord("a"): 0.5, ord("b"): 0.5, ord("c"): -1.0}
    assert request.bad_words_ids == [[ord("x")], [ord("y"), ord("z")]]
    assert request.has_logit_controls and not parse(**GOOD).has_logit_controls


def test_bad_words_that_ban_every_token_are_refused():
    every = words(*(chr(i) for i in range(3)))
    with pytest.raises(InvalidInput, match="^bad_words: .*every token"):
        parse(vocab_size=3, **GOOD, bad_words=every)
    # With min_tokens the end token (2) is banned at first too: two bad words leave nothing.
    two = words(chr(0), chr(1))
    assert parse(vocab_size=3, **GOOD, bad_words=two).bad_words_ids == [[0], [1]]
    with pytest.raises(InvalidInput, match="^bad_words: "):
        parse(vocab_size=3, **GOOD, bad_words=two, min_tokens=i32(1))
