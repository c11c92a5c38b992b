"""TensorRT-LLM's LLM-API schema (specdec/text/llmapi.py) without a server: its inputs as
the ensemble's, read by the one parser; its outputs; its configs against each other."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specdec.paths import PROJECT_ROOT
from specdec.text.llmapi import (
    DEFAULT_MAX_TOKENS,
    OUTPUT_FLAGS,
    PERF_OUTPUTS,
    REFUSED_INPUTS,
    RENAMED_INPUTS,
    answer_arrays,
    cut_at_stop,
    is_stop,
    llmapi_message,
    loop_error_kind,
    parse_llmapi,
)
from specdec.text.request import InvalidInput, parse_requests

REPOSITORY = PROJECT_ROOT / "model_repository"
# Inputs read by name in specdec/text/llmapi.py beside the renamed, refused and flag ones.
OWN_INPUTS = {
    "streaming",
    "stop",
    "sampling_param_best_of",
    "sampling_param_exclude_input_from_output",
}


def tensors(model: str, section: str) -> dict[str, tuple[str, str]]:
    """A config.pbtxt's inputs or outputs: name -> (data_type, dims)."""
    text = (REPOSITORY / model / "config.pbtxt").read_text()
    body = re.search(rf"^{section} \[\n(.*?)^\]", text, re.S | re.M)
    assert body, (model, section)
    found = re.findall(r'name: "(\w+)" data_type: (\w+) dims: \[ ([^\]]*) \]', body.group(1))
    return {name: (data_type, dims.strip()) for name, data_type, dims in found}


def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
    return [ord(c) for c in text]


def loop_parse(inputs: dict[str, np.ndarray]):
    """The BLS's parser on the converted inputs (as speculative_decoding runs it)."""
    (request,) = parse_requests(
        parse_llmapi(inputs).inputs,
        tokenize,
        max_context=64,
        max_draft_tokens=8,
        default_end_id=2,
        vocab_size=300,
    )
    return request


def prompt(text: str = "hi") -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)  # 1-D, as its clients send it


def test_the_decoupled_copy_has_the_same_inputs_and_outputs():
    for section in ("input", "output"):
        assert tensors("tensorrt_llm", section) == tensors("tensorrt_llm_stream", section)


def test_every_declared_input_is_read_and_renamed_ones_keep_the_ensembles_type():
    declared = tensors("tensorrt_llm", "input")
    handled = set(RENAMED_INPUTS) | set(REFUSED_INPUTS) | set(OUTPUT_FLAGS) | OWN_INPUTS
    assert set(declared) == handled
    loop = tensors("speculative_decoding", "input")
    for name, ensemble_name in RENAMED_INPUTS.items():
        assert declared[name][0] == loop[ensemble_name][0], name
    assert all(dims in ("1", "-1") for _, dims in declared.values())  # 1-D


def test_every_output_it_builds_is_declared():
    declared = tensors("tensorrt_llm", "output")
    assert set(declared) == {"text_output", *OUTPUT_FLAGS.values(), *PERF_OUTPUTS}
    loop_perf = {
        "kv_cache_alloc_total_blocks": np.array([[10]], np.int32),
        "kv_cache_reused_blocks": np.array([[4]], np.int32),
        "acceptance_rate": np.array([[0.5]], np.float32),
        "total_accepted_draft_tokens": np.array([[3]], np.int32),
        "total_draft_tokens": np.array([[6]], np.int32),
        "finish_reason": np.array([b"length"], np.object_),
        "cum_log_probs": np.array([[-1.5]], np.float32),
    }
    for name in ("arrival", "first_scheduled", "first_token", "last_token"):
        loop_perf[f"{name}_time_ns"] = np.array([[7]], np.int64)
    flags = {flag: np.array([True]) for flag in OUTPUT_FLAGS}
    request = parse_llmapi(
        {"text_input": prompt(), "sampling_param_return_perf_metrics": np.array([True]), **flags}
    )
    arrays = answer_arrays(request, "x", loop_perf, final=True)
    assert set(arrays) == set(declared)
    types = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64}
    types["TYPE_FP32"] = np.float32
    for name, array in arrays.items():
        assert array.shape == (1,), name
        assert array.dtype == types[declared[name][0]], name
    assert arrays["kv_cache_reused_block"][0] == 4 and arrays["kv_cache_missed_block"][0] == 6
    assert arrays["kv_cache_hit_rate"][0] == pytest.approx(0.4)
    assert arrays["cumulative_logprob"][0] == pytest.approx(-1.5)


def test_its_inputs_reach_the_loops_parser_as_the_ensembles():
    request = loop_parse(
        {
            "text_input": prompt("hello"),
            "sampling_param_max_tokens": np.array([5], np.int32),
            "sampling_param_temperature": np.array([0.7], np.float32),
            "sampling_param_top_k": np.array([3], np.int32),
            "sampling_param_top_p": np.array([0.9], np.float32),
            "sampling_param_seed": np.array([11], np.uint64),
            "sampling_param_presence_penalty": np.array([0.5], np.float32),
            "sampling_param_frequency_penalty": np.array([0.25], np.float32),
            "sampling_param_stop": np.array([b"end", b"stop"], np.object_),
            "return_cumulative_logprob": np.array([True]),
        }
    )
    assert request.prompt_ids == tokenize("hello") and request.max_tokens == 5
    assert (request.temperature, request.top_k, request.seed) == (pytest.approx(0.7), 3, 11)
    assert request.top_p == pytest.approx(0.9)
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, 0.25)
    assert request.stop_words == ["end", "stop"]
    assert request.exclude_input_in_output and request.return_log_probs
    assert not request.stream


def test_defaults_are_the_llm_apis():
    request = loop_parse({"text_input": prompt()})
    assert request.max_tokens == DEFAULT_MAX_TOKENS == 32
    assert request.greedy and not request.return_perf_metrics
    parsed = parse_llmapi({"text_input": prompt("question")})
    assert parsed.outputs == () and not parsed.include_prompt and not parsed.streaming


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"sampling_param_best_of": np.array([2], np.int32)}, "sampling_param_best_of"),
        ({"lora_id": np.array([1], np.uint64)}, "lora_id"),
        ({"image_url": np.array([b"http://x"], np.object_)}, "image_url"),
        ({"streaming": np.array([1], np.int32)}, "streaming"),
    ],
)
def test_what_only_this_schema_has_is_refused_by_its_name(inputs, field):
    with pytest.raises(InvalidInput) as caught:
        parse_llmapi({"text_input": prompt(), **inputs})
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({"sampling_param_max_tokens": np.array([0], np.int32)}, "sampling_param_max_tokens"),
        ({"sampling_param_top_p": np.array([1.5], np.float32)}, "sampling_param_top_p"),
        ({"sampling_param_top_k": np.array([-1], np.int32)}, "sampling_param_top_k"),
        ({"text_input": np.array([b"a", b"b"], np.object_)}, "text_input"),
    ],
)
def test_the_loops_refusals_name_the_llm_api_field(inputs, field):
    with pytest.raises(InvalidInput) as caught:
        loop_parse({"text_input": prompt(), **inputs})
    assert llmapi_message(str(caught.value)).startswith(f"{field}: ")


def test_messages_of_fields_it_does_not_rename_stay():
    assert llmapi_message("text_input: required") == "text_input: required"
    assert llmapi_message("queue full (4 requests)") == "queue full (4 requests)"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("request stopped", "cancelled"),
        ("request cancelled", "cancelled"),
        ("queue full (4 requests waiting for a slot)", "unavailable"),
        ("server is shutting down", "unavailable"),
        ("max_tokens: must be > 0, got 0", "invalid"),
        ("guided_decoding_guide: no token is allowed", "invalid"),
        ("speculative_decoding: engine failed", "internal"),
        ("something broke", "internal"),
    ],
)
def test_loop_errors_are_classified_from_their_messages(message, kind):
    assert loop_error_kind(message, "speculative_decoding") == kind


@pytest.mark.parametrize(
    ("text", "words", "expected"),
    [
        ("Rome is the capital.", ["capital"], ("Rome is the ", "capital")),
        ("Rome is the capital.", ["xyz"], ("Rome is the capital.", None)),
        ("a b c", ["c", "b"], ("a ", "b")),  # the word that ended it: the first to end
        ("abcd", ["bcd", "ab"], ("", "ab")),
        ("abc", [], ("abc", None)),
    ],
)
def test_an_answer_ends_before_its_stop_word(text, words, expected):
    assert cut_at_stop(text, words) == expected


def test_streamed_answers_carry_the_whole_text_and_the_reason_last():
    request = parse_llmapi(
        {
            "text_input": prompt("Q: "),
            "sampling_param_stop": np.array([b"."], np.object_),
            "return_finish_reason": np.array([True]),
            "return_stop_reason": np.array([True]),
            "sampling_param_exclude_input_from_output": np.array([False]),
        }
    )
    assert request.include_prompt
    early = answer_arrays(request, "Rome", {"finish_reason": np.array([b""])}, final=False)
    assert early["text_output"][0] == b"Q: Rome"
    assert early["finish_reason"][0] == b"None" and early["stop_reason"][0] == b"None"
    done = answer_arrays(request, "Rome.", {"finish_reason": np.array([b"stop"])}, final=True)
    assert done["text_output"][0] == b"Q: Rome"
    assert done["finish_reason"][0] == b"stop" and done["stop_reason"][0] == b"."
    ended = answer_arrays(request, "Rome", {"finish_reason": np.array([b"end"])}, final=True)
    assert ended["finish_reason"][0] == b"stop" and ended["stop_reason"][0] == b"None"


def test_a_stop_request_is_told_apart():
    assert is_stop({"stop": np.array([True])})
    assert not is_stop({"stop": np.array([False])}) and not is_stop({})
