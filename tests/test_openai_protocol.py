"""The OpenAI side of the HTTP API without a server: stop sequences, errors, usage."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specdec.openai_api.protocol import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    ResponseBuilder,
    StopTrimmer,
    triton_error,
    triton_params,
    usage,
    validation_error,
)
from specdec.text.request import OUTPUT_ONLY

TRITON_INPUTS = {"text_input", "max_tokens", "num_return_sequences", "presence_penalty"}


@pytest.mark.parametrize(
    ("stop", "chunks", "sent", "stopped"),
    [
        (["\n\n"], ["Hello", " world"], "Hello world", False),
        (["\n\n"], ["one\n", "\ntwo"], "one", True),  # split across chunks
        (["\n\n"], ["a\n", "b"], "a\nb", False),  # a held-back tail that was not a stop
        (["END", "x"], ["abxEND"], "ab", True),  # the first stop in the text wins
        (["stop"], ["st", "o", "p and more"], "", True),
        ([], ["anything"], "anything", False),
    ],
)
def test_stop_trimmer_cuts_at_the_first_stop_and_leaves_it_out(stop, chunks, sent, stopped):
    trimmer = StopTrimmer(stop)
    out = "".join(trimmer.feed(chunk) for chunk in chunks) + trimmer.flush()
    assert out == sent
    assert trimmer.stopped == stopped


def test_stop_trimmer_holds_back_only_a_possible_stop():
    trimmer = StopTrimmer(["<end>"])
    assert trimmer.feed("abc<e") == "abc"
    assert trimmer.feed("x") == "<ex"


def test_validation_errors_name_the_field():
    with pytest.raises(ValidationError) as unknown:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "best_of": 2})
    error = validation_error(unknown.value.errors())
    assert (error.status, error.param) == (400, "best_of")
    assert error.message.startswith("best_of: unknown field")

    with pytest.raises(ValidationError) as nested:
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "function"}]}
        )
    assert validation_error(nested.value.errors()).param.startswith("messages[1]")

    with pytest.raises(ValidationError) as union:
        CompletionRequest.model_validate({"model": "m", "prompt": 3})
    assert validation_error(union.value.errors()).param == "prompt"

    with pytest.raises(ValidationError) as interval:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream_interval": 0})
    assert validation_error(interval.value.errors()).param == "stream_interval"

    with pytest.raises(ValidationError) as salt:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "cache_salt": "s" * 257})
    assert validation_error(salt.value.errors()).param == "cache_salt"


def test_triton_errors_become_openai_errors_naming_the_openai_field():
    bad_n = triton_error(
        "num_return_sequences: must be in 1..64, got 99", TRITON_INPUTS, "prompt", "max_tokens"
    )
    assert (bad_n.status, bad_n.param) == (400, "n")
    assert bad_n.message.startswith("n: must be in 1..64")
    penalty = triton_error("presence_penalty: only 0.0", TRITON_INPUTS, "prompt", "max_tokens")
    assert penalty.param == "presence_penalty"
    limit = triton_error(
        "max_tokens: must be <= 1024", TRITON_INPUTS, "messages", "max_completion_tokens"
    )
    assert limit.param == "max_completion_tokens"
    full = triton_error("queue full (4 requests waiting)", TRITON_INPUTS, "prompt", "max_tokens")
    assert (full.status, full.kind) == (503, "server_error")
    other = triton_error("speculative_decoding: boom", TRITON_INPUTS, "prompt", "max_tokens")
    assert (other.status, other.param) == (500, None)
    assert other.body()["error"]["message"] == "speculative_decoding: boom"


def test_triton_params_send_only_what_was_given():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "stop": ["a", ""], "n": 2, "seed": 5}
    )
    params = triton_params(body, 16)
    assert params["stop_words"] == ["a"]
    assert params["num_return_sequences"] == 2 and params["seed"] == 5
    assert params["temperature"] == 1.0  # OpenAI's default
    assert "num_draft_tokens" not in params and "presence_penalty" not in params
    assert "stream_interval" not in params  # the server's default
    streamed = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_interval": 4}
    )
    assert triton_params(streamed, 16)["stream_interval"] == 4


def test_the_cache_salt_sent_is_the_one_given_never_the_bodys_own():
    """The app passes what the API's keys make of the body's salt (auth.ApiKeys.cache_salt):
    with keys, the body's own must not reach Triton."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "cache_salt": "t-1"})
    assert "cache_salt" not in triton_params(body, 16)
    assert triton_params(body, 16, "f" * 64)["cache_salt"] == "f" * 64


def test_usage_counts_each_prompt_once_and_every_sequence():
    choices = [Choice(i, i // 2, StopTrimmer([]), "", 10 + i // 2, 3) for i in range(4)]
    assert usage(choices) == {"prompt_tokens": 21, "completion_tokens": 12, "total_tokens": 33}


def test_finish_reasons():
    choice = Choice(0, 0, StopTrimmer(["."]), num_input_tokens=5, num_output_tokens=4)
    assert choice.finish_reason(max_tokens=4, max_context=100) == "length"
    assert choice.finish_reason(max_tokens=8, max_context=8) == "length"  # the context
    assert choice.finish_reason(max_tokens=8, max_context=100) == "stop"  # the end token
    choice.add("done. more")
    assert choice.finish_reason(max_tokens=4, max_context=100) == "stop"


def test_streamed_chat_chunks_carry_the_role_once_and_usage_null():
    builder = ResponseBuilder(chat=True, model="m", include_usage=True)
    choice = Choice(0, 0, StopTrimmer([]))
    first, second = (
        builder.chunk(choice, delta) for delta in choice.add("Hi") + choice.add(" there")
    )
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert second["choices"][0]["delta"] == {"content": " there"}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    assert choice.finish() == []
    last = builder.chunk(choice, {}, "stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert builder.usage_chunk([choice])["choices"] == []


def test_sampling_controls_map_to_the_bls_inputs():
    """OpenAI's penalties count the output only (prompt_ignore_length past any prompt);
    logit_bias goes by token id; bad_words (vLLM's) with and without a leading space."""
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "hi",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "logit_bias": {"17": -100, "42": 3.5},
            "repetition_penalty": 1.2,
            "min_p": 0.05,
            "bad_words": ["foo", " bar"],
        }
    )
    params = triton_params(body, 16)
    assert params["presence_penalty"] == 0.5 and params["frequency_penalty"] == -0.25
    assert params["prompt_ignore_length"] == OUTPUT_ONLY
    assert params["logit_bias_ids"] == [17, 42] and params["logit_bias_values"] == [-100, 3.5]
    assert params["repetition_penalty"] == 1.2 and params["min_p"] == 0.05
    assert params["bad_words"] == ["foo", " foo", " bar"]
    plain = triton_params(CompletionRequest.model_validate({"model": "m", "prompt": "hi"}), 16)
    assert not {"prompt_ignore_length", "logit_bias_ids", "bad_words", "min_p"} & set(plain)
    for bad in ({"presence_penalty": 2.5}, {"min_p": 2}, {"logit_bias": {"x": 1}}):
        with pytest.raises(ValidationError) as refused:
            CompletionRequest.model_validate({"model": "m", "prompt": "hi", **bad})
        assert validation_error(refused.value.errors()).param == next(iter(bad))
