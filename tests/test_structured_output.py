"""response_format and tools without a server (specdec/openai_api/structured.py): the guides
they become, checked against xgrammar itself with the target's tokenizer (the BLS compiles
them the same way); the refusals; the conversation as the chat template renders it; the
answer's message and finish_reason."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specdec.openai_api.protocol import (
    ApiError,
    ChatCompletionRequest,
    Choice,
    ResponseBuilder,
    StopTrimmer,
    triton_error,
    validation_error,
)
from specdec.openai_api.structured import Guide, check_structured, guide, template_messages
from specdec.openai_api.tool_calls import ToolCallParser, call_text
from specdec.text.tokenizer import load_tokenizer

xgr = pytest.importorskip("xgrammar")

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_C1 = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = {"role": "assistant", "tool_calls": [CALL_C1]}  # a history's call, id c1
PARIS = call_text("get_weather", '{"city": "Paris"}')
NOW = call_text("get_time", "{}")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


@pytest.fixture(scope="module")
def compiler(target_dir):
    """The BLS's grammars, with its default whitespace (compact)."""
    from specdec.engines.grammar import Grammars

    return Grammars.for_tokenizer(str(target_dir), 49152)


def compile_guide(compiler, guided: Guide):
    """As the BLS compiles guides (specdec/engines/grammar.py)."""
    return compiler.compile((guided.type, guided.text))


def completes(compiled, text: str) -> bool:
    """The grammar takes `text` and may end right after it."""
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_response_format_guides():
    assert guide(request()) is None
    assert guide(request(response_format={"type": "text"})) is None
    any_object = Guide("json_schema", '{"type": "object"}')  # the guide type json: any value
    assert guide(request(response_format={"type": "json_object"})) == any_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {"name": "answer", "schema": schema, "strict": True, "description": "d"}
    guided = guide(request(response_format={"type": "json_schema", "json_schema": spec}))
    assert guided == Guide("json_schema", json.dumps(schema))
    assert guided.triton_params() == {
        "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps(schema),
    }
    no_schema = {"type": "json_schema", "json_schema": {"name": "any"}}
    assert guide(request(response_format=no_schema)) == any_object


def test_json_object_is_an_object(compiler):
    compiled = compile_guide(compiler, guide(request(response_format={"type": "json_object"})))
    assert completes(compiled, '{"a": [1, {"b": null}]}') and completes(compiled, "{}")
    assert not completes(compiled, "[1]") and not completes(compiled, '"text"')


def test_json_schema_guide_compiles_and_constrains(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {"name": "answer", "schema": schema}
    compiled = compile_guide(
        compiler, guide(request(response_format={"type": "json_schema", "json_schema": spec}))
    )
    assert completes(compiled, '{"a": 3}')
    assert not completes(compiled, '{"a": "x"}') and not completes(compiled, "{}")


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "accepted", "refused"),
    [
        (
            None,  # auto
            None,
            ["Plain text.", PARIS, f"Let me look.\n{PARIS}\nThere.", f"{PARIS}\n{NOW}", ""],
            [
                call_text("get_weather", '{"town": "Paris"}'),
                call_text("nope", "{}"),
                "<tool_response>\nSunny\n</tool_response>",  # results come from the tools
            ],
        ),
        (
            "auto",
            False,  # parallel_tool_calls: at most one call
            ["Plain text.", PARIS],
            [f"{PARIS}\n{NOW}"],
        ),
        (
            "required",
            None,
            [
                PARIS,
                NOW,
                f"{PARIS}\n{NOW}",
                call_text("get_weather", '{"city": "Rome", "days": 2}'),
            ],
            ["Plain text.", "", f"Sure.\n{PARIS}", call_text("get_weather", '{"days": 2}')],
        ),
        ("required", False, [PARIS], [f"{PARIS}\n{NOW}"]),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            None,
            [PARIS],
            [NOW, "Plain text.", f"{PARIS}\n{PARIS}", ""],
        ),
    ],
)
def test_tool_guides_compile_and_constrain(compiler, tool_choice, parallel, accepted, refused):
    """The structural tag compiles in xgrammar and takes exactly the calls the choice allows,
    in the format the parser reads, arguments by each function's parameters."""
    fields = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    guided = guide(request(**{k: v for k, v in fields.items() if v is not None}))
    assert guided is not None and guided.type == "structural_tag"
    compiled = compile_guide(compiler, guided)
    for text in accepted:
        assert completes(compiled, text), text
    for text in refused:
        assert not completes(compiled, text), text


def test_arguments_whitespace_is_bounded(compiler):
    """One whitespace character in a row at most: a small model cannot loop on blanks."""
    compiled = compile_guide(compiler, guide(request(tools=TOOLS, tool_choice="required")))
    assert completes(compiled, call_text("get_weather", '{"city":"Paris"}'))
    assert not completes(compiled, call_text("get_weather", '{"city":  "Paris"}'))


def test_tool_choice_none_is_free_text_without_tools_in_the_prompt():
    body = request(tools=TOOLS, tool_choice="none")
    assert guide(body) is None
    assert template_messages(body) == [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "a"}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "a", "tool_call_id": "c"}]},
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "tool_calls": [CALL_C1]}]},
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    *USER,
                    ASKED,
                    {"role": "tool", "tool_call_id": "c2", "content": "1"},
                ]
            },
            "messages[2].tool_call_id",  # answers no call
        ),
        (
            {
                "messages": [
                    *USER,
                    ASKED,
                    {"role": "user", "content": "and?"},
                    {"role": "tool", "tool_call_id": "c1", "content": "1"},
                ]
            },
            "messages[3].tool_call_id",  # not right after the call
        ),
    ],
)
def test_refusals_name_the_field(fields, param):
    with pytest.raises(ApiError) as refused:
        check_structured(request(**fields))
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "extra": 1}}},
            "response_format.json_schema.extra",
        ),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        (
            {"messages": [{"role": "tool", "content": "1", "tool_call_id": 3}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_malformed_fields_are_refused_by_name(fields, param):
    with pytest.raises(ValidationError) as refused:
        request(**fields)
    error = validation_error(refused.value.errors())
    assert (error.status, error.param) == (400, param), error.message


def test_a_bad_guide_from_the_bls_names_the_openai_field():
    """The BLS refuses a guide xgrammar cannot compile, naming guided_decoding_guide: the
    client sees the field it came from."""
    inputs = {"text_input", "guided_decoding_guide", "guided_decoding_guide_type"}
    message = "guided_decoding_guide: not a valid json_schema: bad"
    for field in ("response_format", "tools"):
        error = triton_error(message, inputs, "messages", "max_tokens", field)
        assert (error.status, error.param) == (400, field)
        assert error.message.startswith(f"{field}: not a valid json_schema: bad")


HISTORY = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
                "index": 1,
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
]


def test_a_history_with_tool_calls_renders_in_the_format(target_dir):
    """An agent loop resends its history: the assistant's calls as the model writes them,
    the results in <tool_response>, the tools in the system message after its own text."""
    body = request(messages=HISTORY, tools=TOOLS)
    check_structured(body)
    messages = template_messages(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and "<tools>\n" in system
    assert messages[2]["content"] == f"{PARIS}\n{NOW}"
    assert messages[3]["content"] == "<tool_response>\nSunny, 21 C\n</tool_response>"
    assert messages[4]["content"] == "<tool_response>\n12:00\n</tool_response>"
    prompt = load_tokenizer(str(target_dir)).apply_chat_template(messages)
    assert f"<|im_start|>assistant\n{PARIS}\n{NOW}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tools_prompt_without_a_system_message_and_per_choice():
    auto = template_messages(request(tools=TOOLS))
    assert auto[0]["role"] == "system" and auto[1:] == USER
    assert "Call a function when it helps" in auto[0]["content"]
    required = template_messages(request(tools=TOOLS, tool_choice="required"))
    assert "one or more function calls" in required[0]["content"]
    named = {"type": "function", "function": {"name": "get_time"}}
    assert (
        "function get_time"
        in template_messages(request(tools=TOOLS, tool_choice=named))[0]["content"]
    )
    definitions = auto[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in definitions] == TOOLS  # as given, nulls left out


def tool_choice_of(text: str, stop: list[str] | None = None, num_output: int = 10) -> Choice:
    choice = Choice(0, 0, StopTrimmer(stop or []), tool_calls=ToolCallParser())
    choice.num_input_tokens, choice.num_output_tokens = 5, num_output
    choice.add(text)
    choice.finish()
    return choice


def test_answers_with_calls_have_finish_reason_tool_calls_and_null_content():
    called = tool_choice_of(PARIS)
    assert called.finish_reason(max_tokens=100, max_context=1000) == "tool_calls"
    message = called.message()
    assert message["content"] is None and message["role"] == "assistant"
    (tool_call,) = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    texted = tool_choice_of("No call needed.")
    assert texted.finish_reason(100, 1000) == "stop"
    assert texted.message() == {"role": "assistant", "content": "No call needed."}
    both = tool_choice_of(f"Checking.\n{PARIS}").message()
    assert both["content"] == "Checking." and len(both["tool_calls"]) == 1


def test_a_cut_call_says_why_it_ended():
    """max_tokens or a stop sequence inside a call: the call as far as it got, and
    finish_reason length or stop, never tool_calls."""
    cut = PARIS[: PARIS.index("Paris")]
    assert (
        tool_choice_of(cut, num_output=10).finish_reason(max_tokens=10, max_context=1000)
        == "length"
    )
    stopped = tool_choice_of(PARIS, stop=["Par"])
    assert stopped.finish_reason(100, 1000) == "stop"
    assert stopped.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "'


def test_whole_chat_response_carries_the_calls():
    builder = ResponseBuilder(chat=True, model="m")
    body = builder.whole([tool_choice_of(PARIS)], max_tokens=100, max_context=1000)
    (item,) = body["choices"]
    assert item["finish_reason"] == "tool_calls" and item["message"]["tool_calls"]
    plain = Choice(0, 0, StopTrimmer([]))
    plain.add("Hi")
    assert builder.whole([plain], 100, 1000)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hi",
    }
