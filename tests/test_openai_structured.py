"""Structured output through the OpenAI API on the real server, with the official `openai`
package: response_format (json_object, json_schema) and tools (required, a named function,
auto), whole and streamed, refusals, and an agent loop that sends a tool's result back.
Greedy throughout, so each answer is the target's own under its grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from specdec.text.tokenizer import load_tokenizer
from test_openai_api import MODEL, api  # noqa: F401 - the fixture: the API on the test server

pytestmark = pytest.mark.server

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        # bounded, as every field here: unbounded, the 135M model's greedy answer under the
        # compact grammar writes 1111... until max_tokens
        "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone.",
            "parameters": TIME_PARAMETERS,
        },
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# An agent's earlier exchange: one worked call and its result. The 135M target does not
# write a call unasked (tool_choice "auto"), and repeats calls under "required", without one.
EARLIER = [
    {"role": "user", "content": "What is the weather in Rome, in celsius?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_rome",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Rome", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_rome", "content": "Sunny, 24 degrees celsius."},
    {"role": "assistant", "content": "It is sunny in Rome, 24 degrees celsius."},
]
ASKED = EARLIER + WEATHER_QUESTION
MAX_TOKENS = 96
JSON_OBJECT = {"type": "json_object"}
DESCRIBE_PARIS = [{"role": "user", "content": "Describe Paris: its city, country and population."}]
CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client(api):  # noqa: F811 - the imported fixture
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)


def chat(client, messages, **fields):
    fields.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **fields)


def streamed(client, messages, **fields) -> tuple[str | None, list[dict], str]:
    """A streamed answer put together as a client does: content, calls by index (id, type
    and name from each call's first delta), the last finish_reason."""
    content, calls, reason = None, [], None
    for chunk in chat(client, messages, stream=True, **fields):
        (choice,) = chunk.choices
        delta = choice.delta
        if delta.content:
            content = (content or "") + delta.content
        for piece in delta.tool_calls or []:
            if piece.index == len(calls):  # a new call: everything but its arguments
                assert piece.id and piece.type == "function" and piece.function.name
                assert piece.function.arguments == ""
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
        reason = choice.finish_reason or reason
    return content, calls, reason


def checked_calls(message) -> list[tuple[str, dict]]:
    """The answer's calls as (name, arguments), each validated against its function."""
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({call.id for call in message.tool_calls}) == len(calls)
    return calls


def test_json_object_answers_a_json_object(client):
    """An object, not any JSON value: asked this, the target's greedy choice under a grammar
    of any JSON value is an array."""
    messages = [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    for stream in (False, True):
        if stream:
            content, calls, reason = streamed(client, messages, response_format=JSON_OBJECT)
        else:
            choice = chat(client, messages, response_format=JSON_OBJECT).choices[0]
            content, calls, reason = (
                choice.message.content,
                choice.message.tool_calls,
                choice.finish_reason,
            )
        assert reason == "stop" and not calls, (content, reason)
        assert isinstance(json.loads(content), dict), content


def test_json_schema_answers_follow_the_schema_whole_and_streamed(client):
    answer = chat(client, DESCRIBE_PARIS, response_format=CITY_FORMAT)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    content, calls, reason = streamed(client, DESCRIBE_PARIS, response_format=CITY_FORMAT)
    assert (content, calls, reason) == (choice.message.content, [], "stop")


def test_tool_choice_required_calls_tools_with_valid_arguments(client):
    for messages, fields in ((ASKED, {}), (WEATHER_QUESTION, {"parallel_tool_calls": False})):
        answer = chat(client, messages, tools=TOOLS, tool_choice="required", **fields)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = checked_calls(choice.message)
        assert calls[0] == ("get_weather", {"city": "Paris", "unit": "celsius"}), calls
        if fields:
            assert len(calls) == 1


def test_a_named_tool_choice_calls_that_function_once(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for messages in (ASKED, WEATHER_QUESTION):
        choice = chat(client, messages, tools=TOOLS, tool_choice=named).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [(name, _)] = checked_calls(choice.message)
        assert name == "get_time"


def test_tool_choice_auto_calls_or_answers_in_text(client):
    """The model chooses: asked for the weather it calls get_weather; asked for a poem it
    writes text (greedy: the same choice every run)."""
    called = chat(client, ASKED, tools=TOOLS).choices[0]
    assert called.finish_reason == "tool_calls", called
    assert checked_calls(called.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    poem = EARLIER + [{"role": "user", "content": "Write two lines about the sea."}]
    texted = chat(client, poem, tools=TOOLS, tool_choice="auto").choices[0]
    assert texted.finish_reason == "stop" and texted.message.tool_calls is None, texted
    assert texted.message.content


@pytest.mark.parametrize(
    "tool_choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_equal_the_whole_answer(client, tool_choice):
    whole = chat(client, ASKED, tools=TOOLS, tool_choice=tool_choice).choices[0]
    content, calls, reason = streamed(client, ASKED, tools=TOOLS, tool_choice=tool_choice)
    assert reason == whole.finish_reason == "tool_calls"
    assert content == whole.message.content
    expected = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    assert [(call["name"], call["arguments"]) for call in calls] == expected
    assert len({call["id"] for call in calls}) == len(calls)


def test_an_agent_loop_sends_the_tool_result_back(client, target_dir):
    """Call, run the tool, resend the history with its result: the model answers from the
    result; and the prompt it gets is the history as written out here, token for token."""
    first = chat(client, ASKED, tools=TOOLS).choices[0]
    (call,) = first.message.tool_calls
    assert json.loads(call.function.arguments)["city"] == "Paris"
    history = [
        *ASKED,
        first.message,  # as the openai package resends it
        {"role": "tool", "tool_call_id": call.id, "content": "Cloudy, 18 degrees celsius."},
    ]
    final = chat(client, history, tools=TOOLS).choices[0]
    assert final.finish_reason == "stop" and final.message.tool_calls is None, final
    assert "18" in final.message.content  # it read the result

    without_tools = chat(client, history, tools=TOOLS, tool_choice="none", max_tokens=1)

    def turn(role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    def called(city: str) -> str:
        arguments = f'{{"city": "{city}", "unit": "celsius"}}'
        return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'

    expected_prompt = (
        turn("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        + turn("user", "What is the weather in Rome, in celsius?")
        + turn("assistant", called("Rome"))
        + turn("tool", "<tool_response>\nSunny, 24 degrees celsius.\n</tool_response>")
        + turn("assistant", "It is sunny in Rome, 24 degrees celsius.")
        + turn("user", "What is the weather in Paris, in celsius?")
        + turn("assistant", called("Paris"))
        + turn("tool", "<tool_response>\nCloudy, 18 degrees celsius.\n</tool_response>")
        + "<|im_start|>assistant\n"
    )
    tokenizer = load_tokenizer(str(target_dir))
    assert without_tools.usage.prompt_tokens == len(tokenizer.encode(expected_prompt))


def test_stop_and_max_tokens_cut_a_structured_answer_and_say_so(client):
    """A stop sequence or max_tokens ends the answer wherever it falls, grammar or not:
    finish_reason says which, and the text is what came before."""
    whole = chat(client, DESCRIBE_PARIS, response_format=CITY_FORMAT).choices[0].message.content
    cut = chat(client, DESCRIBE_PARIS, response_format=CITY_FORMAT, stop=[","]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == whole[: whole.index(",")]
    short = chat(client, DESCRIBE_PARIS, response_format=CITY_FORMAT, max_tokens=3).choices[0]
    assert short.finish_reason == "length" and whole.startswith(short.message.content)
    call = chat(client, ASKED, tools=TOOLS, tool_choice="required", max_tokens=20).choices[0]
    assert call.finish_reason == "length"
    (cut_call,) = call.message.tool_calls  # as far as it got: its arguments are not whole
    assert cut_call.function.name == "get_weather"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut_call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_xgrammar_refuses_is_a_400_naming_the_field(client, stream):
    """The BLS refuses the guide by name; the API names the OpenAI field it came from; the
    next request is served."""
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}}
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, WEATHER_QUESTION, response_format=response_format, stream=stream)
    assert refused.value.param == "response_format", refused.value.body
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    with pytest.raises(openai.BadRequestError) as refused_tools:
        chat(client, WEATHER_QUESTION, tools=tools, tool_choice="required", stream=stream)
    assert refused_tools.value.param == "tools", refused_tools.value.body
    assert chat(client, WEATHER_QUESTION, max_tokens=4).choices[0].message.content


def test_malformed_requests_are_refused_before_triton(client):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(
            client,
            WEATHER_QUESTION,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    assert refused.value.param == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as no_name:
        chat(client, WEATHER_QUESTION, response_format={"type": "json_schema", "json_schema": {}})
    assert no_name.value.param == "response_format.json_schema.name"
